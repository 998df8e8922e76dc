"""In-process recovery: survivors of a peer's failure re-form the group and go on.

With ``elastic.recovery = "inprocess"`` a failed collective does not end the
worker. :func:`recover` aborts the broken group, agrees the new members
through etcd (:mod:`elastic_train.training.membership`), forms a new default
group on a fresh store prefix, rolls back at most the step in flight from
memory, agrees on the newest step among the survivors (a ring all-reduce can
finish on one rank and fail on another: the newest state is broadcast, no
optimizer step is undone), and rebuilds what depends on rank and world size:
the DDP wrapper (never the old reducer), the data loader workers, the audit
writer (a new attempt with a resume record ``source="inprocess"``), the
checkpoint writer and the progress marker when rank 0 changed.

Anything it cannot handle (fenced out, no agreement, a peer failing in every
one of ``elastic.inprocess_max_reforms`` re-forms, a failure that killed
nobody) raises, the worker exits, and torchrun's agent restarts the group:
the restart path is the safety net. See docs/recovery-inprocess.md.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from elastic_train.audit import AuditWriter
from elastic_train.errors import ElasticTrainError, InProcessRecoveryError, MemberLostError
from elastic_train.log import bind_context, get_logger
from elastic_train.training import heal, next_group, rollback
from elastic_train.training.distributed import DistContext, generation_attempt_id
from elastic_train.training.etcd_access import EtcdAccess
from elastic_train.training.membership import Generation, Membership
from elastic_train.training.progress_marker import ProgressMarker
from elastic_train.training.step import StepOutcome, run_step
from elastic_train.training.step_timeout import StepTimeout
from elastic_train.training.tracking import open_tracking

if TYPE_CHECKING:
    from elastic_train.training.admission import JoinWatch
    from elastic_train.training.loop import Trainer

log = get_logger(__name__)

#: Seconds a group abort may take before the worker gives up (NCCL's can hang).
_ABORT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LoopHooks:
    """What the loop lends the re-form (passed in: this module does not import the loop)."""

    state_dict: Callable[[Trainer], dict[str, Any]]
    load_state_dict: Callable[[Trainer, dict[str, Any]], None]
    #: The two halves of load_state_dict, for a healing joiner (training/heal.py).
    load_progress: Callable[[Trainer, dict[str, Any]], None]
    load_weights: Callable[[Trainer, dict[str, Any]], None]
    wrap: Callable[[Trainer, DistContext], Any]  # the training wrapper (DDP) for the new group
    open_checkpoints: Callable[[Trainer, DistContext], Any]


@dataclass
class InProcess:
    """One worker's in-process recovery: its membership and its counters."""

    membership: Membership
    hooks: LoopHooks
    max_reforms: int
    probe_seconds: float
    pg_timeout_seconds: float
    timeout: StepTimeout
    recoveries: int = 0
    #: Recoveries since the last completed step: a failure that every re-form
    #: meets again (not a peer's death) ends in the restart path.
    unsettled: int = 0
    #: Async joins (training/admission.py): rank 0's watch of the join requests, whether
    #: the last check step agreed to admit, the generation rank 0 last published.
    joins: JoinWatch | None = None
    admit_due: bool = False
    published: int = -1
    #: The next group, formed in the background after an admit vote (next_group.py),
    #: and what the last check step said of it on every member: "ready", "failed".
    forming: next_group.Formation | None = None
    forming_verdict: str | None = None
    forming_step: int = 0  # the step after which it started
    #: A healing joiner until the members' model and optimizer are loaded (heal.py).
    stateless: bool = False

    @classmethod
    def start(cls, t: Trainer, hooks: LoopHooks) -> InProcess | None:
        """Register generation 0 (the group torchrun formed); None when the switch is off."""
        if t.cfg.elastic.recovery != "inprocess":
            return None
        ip = cls.create(t, hooks, Membership(EtcdAccess.from_env(), lineage=t.attempt,
                                             node=t.ctx.env.node))  # fmt: skip
        deadline = time.monotonic() + t.cfg.elastic.pg_timeout_seconds
        ip.membership.register(rank=t.ctx.rank, world_size=t.ctx.world_size, deadline=deadline)
        return ip

    @classmethod
    def create(cls, t: Trainer, hooks: LoopHooks, membership: Membership) -> InProcess:
        elastic = t.cfg.elastic
        watchdog = t.guards.watchdog
        timeout = StepTimeout(
            full_s=elastic.pg_timeout_seconds, multiple=elastic.inprocess_timeout_multiple,
            floor_s=elastic.inprocess_timeout_floor_seconds,
            watchdog=watchdog.current_timeout if watchdog is not None else None,
        )  # fmt: skip
        timeout.attach(t.ctx.backend)
        return cls(
            membership, hooks, max_reforms=elastic.inprocess_max_reforms,
            probe_seconds=elastic.inprocess_probe_seconds,
            pg_timeout_seconds=elastic.pg_timeout_seconds, timeout=timeout,
        )  # fmt: skip

    def join_wanted(self) -> bool:
        """Rank 0's vote in the check step's all-reduce: a node waits to be admitted."""
        return self.joins is not None and self.joins.wanted()

    def close(self) -> None:
        if self.joins is not None:
            self.joins.close()
        if self.forming is not None:
            self.forming.drop()
        current = self.membership.current
        if current is not None and current.rank == 0 and self.published >= 0:
            try:  # no node may ask a group that is gone to admit it
                self.membership.retire_active()
            except ElasticTrainError as exc:
                log.warning("inprocess_marker_not_retired", error=str(exc))
        self.membership.close()


def abort_group(t: Trainer, *, planned: bool = False) -> None:
    """Drop DDP (its reducer holds the broken group) and destroy the group.

    NCCL communicators are aborted first, under a timeout since that can hang.
    Gloo's are not: its abort took seconds here (2 cores, loaded), during which
    the liveness responder starved, and it does not wake a survivor blocked in
    a receive either (docs/recovery-inprocess.md, step 3).

    ``planned``: every member leaves the group at the same step boundary (an
    admission, a departure), so no peer waits in a receive from this rank.
    Then a gloo group's destructor, 20-30 ms of joining its threads that it
    spends without the GIL, runs in a thread of its own instead of stalling the
    members. After a failure it runs here: the sockets it closes are what wakes
    a survivor blocked on this rank.
    """
    t.__dict__.pop("ddp", None)
    gc.collect()  # the reducer must go while the group is registered (see loop.close)
    if not dist.is_initialized():
        return
    gloo = t.ctx.backend == "gloo"
    retired = [dist.distributed_c10d._get_default_group()] if planned and gloo else []
    if t.ctx.backend == "nccl":  # untested without a GPU: kept small and guarded
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is None:
            raise InProcessRecoveryError("this torch cannot abort an NCCL group in place")
        _run_guarded(abort, seconds=_ABORT_TIMEOUT_S)
    if dist.is_initialized():  # the abort also deregisters the group
        dist.destroy_process_group()
    gc.collect()
    next_group.release(retired)


def _run_guarded(call: Callable[[], Any], *, seconds: float) -> None:
    """``call()`` in a thread; :class:`InProcessRecoveryError` if it takes over ``seconds``."""
    done, failed = threading.Event(), []

    def run() -> None:
        try:
            call()
        except Exception as exc:  # torch's: the destroy that follows still frees the group
            failed.append(f"{type(exc).__name__}: {exc}")
        finally:
            done.set()

    threading.Thread(target=run, name="group-abort", daemon=True).start()
    if not done.wait(seconds):
        raise InProcessRecoveryError(f"aborting the process group took over {seconds} s")
    if failed:
        log.warning("process_group_abort_failed", error=failed[0][:300])


def form_group(t: Trainer, gen: Generation, *, timeout: float) -> DistContext:
    """The new default group of ``gen`` on its rank 0's store, checked by a barrier
    (on a member whose admission formed the group in the background, that
    barrier was the formation's last act: :mod:`.next_group`)."""
    ip = t.inprocess
    assert ip is not None
    store = gen.store(ip.membership.endpoints, timeout=timeout, probe_timeout=ip.probe_seconds)
    if next_group.available(t.ctx.backend):  # named as the members' admission names it
        next_group.install(next_group.form(store, gen, timeout=timeout))
    else:
        dist.init_process_group(
            t.ctx.backend, store=store, rank=gen.rank, world_size=gen.world_size,
            timeout=timedelta(seconds=timeout),
            device_id=t.ctx.device if t.ctx.backend == "nccl" else None,
        )  # fmt: skip
    dist.barrier()
    return context_of(t, gen)


def context_of(t: Trainer, gen: Generation) -> DistContext:
    """``t``'s context with ``gen``'s rank and world size."""
    return DistContext(
        env=dataclasses.replace(t.ctx.env, rank=gen.rank, world_size=gen.world_size),
        backend=t.ctx.backend, device=t.ctx.device,
    )  # fmt: skip


def reform(t: Trainer, *, first: Generation | None = None) -> tuple[DistContext, float, float]:
    """Agree and form, retrying when a peer fails meanwhile; the context and the
    seconds spent agreeing and forming. ``first``: a generation agreed already
    (an admission of joiners), tried before any new agreement."""
    ip = t.inprocess
    assert ip is not None
    agreement_s = group_s = 0.0
    for attempt in range(ip.max_reforms):
        started = time.perf_counter()
        # Every member alive is possible: a collective timed out on a slow peer,
        # or a receive from the dead peer outlived the others' recovery (gloo
        # wakes it only at the timeout). The same members re-form then.
        if attempt == 0 and first is not None:
            gen = first
        else:
            gen = ip.membership.agree(probe_timeout=ip.probe_seconds)
        agreed = time.perf_counter()
        agreement_s += agreed - started
        if gen.nodes < ip.membership.access.min_nodes:
            raise InProcessRecoveryError(
                f"{gen.nodes} nodes left, fewer than --nnodes' minimum "
                f"{ip.membership.access.min_nodes}: the restart path waits for more"
            )
        try:
            ctx = form_group(t, gen, timeout=ip.pg_timeout_seconds)
            return ctx, agreement_s, group_s + time.perf_counter() - agreed
        except (RuntimeError, MemberLostError) as exc:  # torch's DistError, store errors
            group_s += time.perf_counter() - agreed
            log.warning("inprocess_reform_failed", generation=gen.number, error=str(exc))
            if dist.is_initialized():
                dist.destroy_process_group()
    raise InProcessRecoveryError(f"no group formed in {ip.max_reforms} re-forms")


def rebuild(t: Trainer, hooks: LoopHooks, *, was_main: bool, joining: bool = False) -> None:
    """Everything that depends on rank and world size, for the new group (``t.ctx``)."""
    ctx = t.ctx
    bind_context(rank=ctx.rank, world_size=ctx.world_size)
    t.guards.preemption.resync()
    ip = t.inprocess
    gen = ip.membership.current if ip is not None else None
    assert ip is not None and gen is not None  # regroup's, after a formation
    ip.admit_due = False  # a vote taken before the failure is for a group that is gone
    t.ddp = hooks.wrap(t, ctx)  # a new reducer over the weights take_newest made equal
    t.batches.start(t.sampler, step=t.step, rank=ctx.rank, world_size=ctx.world_size,
                    training=t.cfg.training, first_ranks=heal.data_ranks(t))  # fmt: skip
    t.attempt = generation_attempt_id(ip.membership.lineage, gen.number)  # no collective
    if t.cfg.logging.audit_dir:  # a joiner has none yet
        if t.audit is not None:
            t.audit.close()
        t.audit = AuditWriter(
            t.cfg.logging.audit_dir, attempt=t.attempt, rank=ctx.rank,
            world_size=ctx.world_size, node=ctx.env.node,
        )  # fmt: skip
        t.audit.resume(restored_step=t.step, source="inprocess")
    if ctx.is_main != was_main or joining:
        # Old rank 0 died or left (or this worker joined): the checkpoint, the progress
        # marker and the experiment trackers need their writer here. The trackers'
        # watermark (tracking.json) makes the new rank 0 skip the steps the old one
        # handed over already.
        if t.checkpoint is not None:
            t.checkpoint.close()
        t.checkpoint = hooks.open_checkpoints(t, ctx)
        t.last_saved_step = -1  # the first due save writes, whatever the old writer did
        t.progress.close()
        t.progress = ProgressMarker(t.cfg.checkpoint.dir, writer=ctx.is_main)
        t.tracking.close()
        t.tracking = open_tracking(t.cfg, is_main=ctx.is_main)


def regroup(
    t: Trainer, *, first: Generation | None = None, joining: bool = False,
    planned: bool = False, formed: next_group.Formation | None = None, heal: bool = False,
) -> tuple[int, dict[str, float]]:  # fmt: skip
    """Abort the group, form the next one (``first`` if given), bring every member to
    the newest state, rebuild; the step in flight and the seconds of each phase.
    ``planned``: :func:`abort_group`'s (an admission or a departure, not a failure).
    ``formed``: the formation whose group is generation ``first``'s, formed in the
    background already (taken here: a caller holding it would keep its sockets open).
    ``heal``: this rank's vote to bring the joiners their state during the next step
    (heal.py). A peer failing while the state moves costs another formation without it."""
    ip = t.inprocess
    assert ip is not None
    t.heal = None  # a transfer in flight belongs to the group that is going
    joining = joining or ip.stateless  # a joiner whose healing a failure cut short
    # A failure's re-form keeps warm members only, unless a newer generation let a
    # joiner in; an admission's (``first``) brings a cold one (StepTimeout.attach).
    gen = ip.membership.current
    stepped = None if first is not None or joining or gen is None else gen.ids
    abort_group(t, planned=planned)
    was_main, old_world = t.ctx.is_main, t.ctx.world_size
    in_flight = rollback.rewind(t)
    timings = {"agreement_s": 0.0, "group_init_s": 0.0, "rollback_s": 0.0}
    failed = False
    for _ in range(ip.max_reforms):
        _form(t, first=first, formed=formed, timings=timings)
        # A shortened timeout (the step's, or the last try's) after which every
        # member is still there killed nobody.
        timed_out = failed or (ip.timeout.short_s is not None and first is None)
        if timed_out and t.ctx.world_size == old_world:
            ip.timeout.widen()
        now = ip.membership.current
        warm = stepped is not None and now is not None and now.ids <= stepped
        ip.timeout.attach(t.ctx.backend, scale=old_world / t.ctx.world_size,
                          warm=warm and not t.cfg.training.compile)  # fmt: skip
        old_world = t.ctx.world_size
        started = time.perf_counter()
        failure = rollback.take_newest(t, ip.hooks, joining=joining, timeout=ip.timeout,
                                       heal=heal and not failed)  # fmt: skip
        timings["rollback_s"] += time.perf_counter() - started
        if failure is None:
            break
        gen = ip.membership.current
        log.warning("inprocess_rollback_failed", generation=gen.number if gen else None,
                    error=failure[:300])  # fmt: skip
        abort_group(t)
        first, formed, failed = None, None, True
    else:
        raise InProcessRecoveryError(f"a peer failed in each of {ip.max_reforms} state transfers")
    started = time.perf_counter()
    rebuild(t, ip.hooks, was_main=was_main, joining=joining)
    timings["rebuild_s"] = time.perf_counter() - started
    return in_flight, {name: round(seconds, 4) for name, seconds in timings.items()}


def _form(
    t: Trainer, *, first: Generation | None, formed: next_group.Formation | None,
    timings: dict[str, float],
) -> None:  # fmt: skip
    """The next group as the default group and ``t.ctx`` (see :func:`regroup`)."""
    if formed is not None and first is not None:
        started = time.perf_counter()
        next_group.install(formed.take()[1])
        t.ctx = context_of(t, first)
        timings["group_init_s"] += time.perf_counter() - started
        return
    t.ctx, agreement_s, group_s = reform(t, first=first)
    timings["agreement_s"] += agreement_s
    timings["group_init_s"] += group_s


def recover(t: Trainer, failure: str) -> None:
    """Re-form the group in place after ``failure`` (a broken collective's error),
    or raise :class:`InProcessRecoveryError` for the restart path."""
    ip = t.inprocess
    assert ip is not None
    # From the failed step's start: an upper bound of the detection, which cannot
    # see the moment the peer died (the runner measures kill -> first step).
    detection_s = time.perf_counter() - t.step_started_at
    began = time.time()
    step_timeout_s = ip.timeout.short_s or ip.timeout.full_s  # the failed step's
    log.warning("inprocess_recovery_started", step=t.step, error=failure[:300],
                step_timeout_s=round(step_timeout_s, 3))  # fmt: skip
    try:
        with t.guards.long_operation("inprocess_recovery"):
            settle_formation(ip)
            in_flight, timings = regroup(t)
    except InProcessRecoveryError as exc:
        log.error("inprocess_recovery_failed", error=str(exc), after=failure[:300],
                  fallback="restart")  # fmt: skip
        raise
    ip.recoveries += 1
    lost = max(0, in_flight - t.step)
    t.metrics.resumed(restored_step=t.step, lost_steps=lost)
    gen = ip.membership.current
    assert gen is not None
    t.metrics.regrouped(cause="failure", started_at=began, nodes=gen.nodes)
    log.info(
        "inprocess_recovered", step=t.step, lost_steps=lost, world_size=t.ctx.world_size,
        rank=t.ctx.rank, attempt=t.attempt, detection_s=round(detection_s, 4), **timings,
        recoveries=ip.recoveries, step_timeout_s=round(step_timeout_s, 3),
    )  # fmt: skip


def settle_formation(ip: InProcess) -> None:
    """Wait out and drop a next group in flight (:mod:`.next_group`): its thread
    uses the membership and the stores that a re-form is about to use."""
    forming, ip.forming, ip.forming_verdict = ip.forming, None, None
    if forming is None:
        return
    if not forming.finish(timeout=next_group.FORMATION_TIMEOUT_S + ip.probe_seconds):
        raise InProcessRecoveryError("the next group's formation did not end")
    forming.drop()


def run_step_or_recover(t: Trainer, *, state: Callable[[], dict[str, Any]]) -> StepOutcome:
    """:func:`run_step`; with in-process recovery on, a broken collective re-forms
    the group instead of ending the worker (the step is then redone)."""
    if t.inprocess is None:
        return run_step(t, state=state)
    t.inprocess.timeout.step_started()
    try:
        outcome = run_step(t, state=state)
        t.inprocess.unsettled = 0
        t.inprocess.timeout.step_done()
        return outcome
    except RuntimeError as exc:  # torch's DistError family: a peer's death broke a collective
        error = f"{type(exc).__name__}: {exc}"
    t.inprocess.unsettled += 1
    if t.inprocess.unsettled > t.inprocess.max_reforms:
        raise InProcessRecoveryError(
            f"{t.inprocess.unsettled} recoveries without a completed step; last error: {error}"
        )
    # Out of the except block: the traceback's frames (the failed step's work
    # objects, DDP's no_sync context) hold the broken group, and its sockets
    # must close for the survivors still blocked on this rank to notice.
    recover(t, error)
    return StepOutcome(signalled=None, epoch_ended=False)


_T = TypeVar("_T")


def collective_or_recover(t: Trainer, call: Callable[[], _T], *, what: str) -> _T:
    """``call``, collectives between steps (an evaluation); with in-process recovery
    on, a peer's failure during it re-forms the group and ``call`` runs again at
    the new size. No step is in flight between steps: nothing is rolled back."""
    if t.inprocess is None:
        return call()
    for _ in range(t.inprocess.max_reforms):
        try:
            return call()
        except RuntimeError as exc:  # torch's DistError family
            error = f"{type(exc).__name__}: {exc}"
        recover(t, f"{what}: {error}")  # out of the except block: see run_step_or_recover
    raise InProcessRecoveryError(f"{what}: {t.inprocess.max_reforms} recoveries did not finish it")
