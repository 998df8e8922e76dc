"""Async joins: a node entering the job joins the running in-process group at a step
boundary, and the members keep their processes.

With ``elastic.recovery = "inprocess"`` (docs/recovery-inprocess.md, "Joins"):

1. The group's rank 0 keeps the marker (``etcd/group_marker.py``) and a
   :class:`JoinWatch` on the lineage's join requests (an etcd watch: no
   requests while nobody asks).
2. A node that arrives gets a side round from its agent
   (``rendezvous/side_round.py``): its workers start alone, with
   :data:`ASYNC_JOIN_ENV`. They build the model and the data while the
   group trains (the imports, the compile of the data: the slow part of a
   restart), skip the restore, put a join request in etcd and wait.
3. Rank 0 votes in the next check step's all-reduce (``step.Agreement``), so
   every member learns at the same step that somebody waits. After that step
   every member starts forming generation ``g + 1`` = the members and the live
   joiners (up to ``--nnodes``' maximum) in a thread (:func:`begin`,
   ``next_group.Formation``) and trains on; the joiners form their side of it
   (:func:`enter`). At the boundary of the first check step that finds the
   group ready on every member, :func:`switch` makes it the default group, the
   joiners heal: they receive the model and the optimizer during the next step,
   which the members' shares cover alone (:mod:`.heal`; or, with
   ``elastic.heal_joins`` off, the whole state by broadcast before it,
   ``roll_back(joining=True)``), and everybody rebuilds for the new world.
   Where that cannot run (NCCL, a torch without the registry call),
   :func:`admit` forms it at the boundary, and the state goes by broadcast.

The members stall for the switch only: no worker restart, no re-import, no
reload. A failure during the admission is handled as any other (another
agreement without the dead, or the restart path).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic_train.errors import ConfigError, ElasticTrainError, MemberLostError
from elastic_train.etcd.group_marker import answers
from elastic_train.log import get_logger
from elastic_train.training import heal, next_group
from elastic_train.training.etcd_access import EtcdAccess, json_from_env
from elastic_train.training.inprocess import (
    InProcess,
    LoopHooks,
    abort_group,
    recover,
    regroup,
    settle_formation,
)
from elastic_train.training.membership import Generation, Member, Membership, probe

if TYPE_CHECKING:
    from elastic_train.training.loop import Trainer

log = get_logger(__name__)

#: rendezvous/side_round.py's: set by the agent for the workers of a side round.
ASYNC_JOIN_ENV = "ELASTIC_TRAIN_ASYNC_JOIN"
#: Seconds a watch waits before it re-reads anyway (a lost watch costs at most this).
_WATCH_S = 5.0


@dataclass(frozen=True)
class JoinTicket:
    """The running group a side round's workers join: the JSON of :data:`ASYNC_JOIN_ENV`."""

    lineage: str
    generation: int
    host: str  # where the group's head answers a ping (etcd/group_marker.py)
    ping_port: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> JoinTicket | None:
        return json_from_env(ASYNC_JOIN_ENV, lambda fields: cls(**fields), environ)


def joining(recovery: str, environ: Mapping[str, str] = os.environ) -> JoinTicket | None:
    """The ticket of a worker that enters a running group; a ConfigError if it cannot."""
    ticket = JoinTicket.from_env(environ)
    if ticket is not None and recovery != "inprocess":
        raise ConfigError(
            f"this node's agent joined a running in-process group ({ASYNC_JOIN_ENV} is set) "
            f"but elastic.recovery = {recovery!r}: every node of a job needs the same recovery"
        )
    return ticket


class JoinWatch:
    """Rank 0's view of the join requests, kept by a thread that re-reads them when
    etcd says they changed."""

    def __init__(self, membership: Membership) -> None:
        self._membership = membership
        self._requests: list[Member] = []
        self._closed = threading.Event()
        threading.Thread(target=self._run, name="join-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                requests, revision = self._membership.join_requests()
                seen = {m.id for m in self._requests}
                new = [m.id for m in requests if m.id not in seen]
                self._requests = requests  # before the line: who reads it sees the vote
                if new:
                    log.info("inprocess_join_requested", joiners=new)
                self._membership.watch_joins(start_revision=revision + 1, timeout=_WATCH_S)
            except Exception as exc:  # etcd's, or a client closed under the thread
                if self._closed.is_set():
                    return
                log.warning("join_watch_error", error=f"{type(exc).__name__}: {exc}")
                self._closed.wait(1.0)

    def _pending(self) -> tuple[list[Member], set[str]]:
        """The requests of workers not in the group yet, that ``--nnodes``' maximum
        leaves room for (judged against the group now: the watch may lag an
        admission), and the group's nodes."""
        current = self._membership.current
        assert current is not None
        nodes = {m.node for m in current.members}
        ids, room = current.ids, self._membership.access.max_nodes
        pending = [m for m in self._requests if m.id not in ids]
        fits = [m for m in pending if m.node in nodes or len(nodes) < room]
        return fits, nodes

    def wanted(self) -> bool:
        return bool(self._pending()[0])

    def admissible(self, *, probe_timeout: float) -> list[Member]:
        """The waiting joiners that answer a ping, as many nodes as ``--nnodes``'
        maximum leaves room for; the requests of those that do not answer are withdrawn."""
        pending, nodes = self._pending()
        admitted, dead = [], []
        for member in pending:
            node = member.node
            if not probe(member, timeout=probe_timeout):
                dead.append(member)
            elif node in nodes or len(nodes) < self._membership.access.max_nodes:
                nodes.add(node)
                admitted.append(member)
        self._membership.withdraw_requests(dead)
        return admitted

    def close(self) -> None:
        self._closed.set()


def start(t: Trainer, hooks: LoopHooks) -> InProcess | None:
    """In-process recovery for ``t``: generation 0 of the group torchrun formed, or,
    for a side round's worker, the running group it is admitted to."""
    ticket = joining(t.cfg.elastic.recovery)
    if ticket is None:
        return InProcess.start(t, hooks)
    membership = Membership(
        EtcdAccess.from_env(), lineage=ticket.lineage, node=t.ctx.env.node, joined=True
    )
    t.inprocess = InProcess.create(t, hooks, membership)
    enter(t, ticket)
    return t.inprocess


def enter(t: Trainer, ticket: JoinTicket) -> None:
    """The joiner: ask, wait for a generation that holds this worker, form it, take
    the newest state from the members."""
    ip = t.inprocess
    assert ip is not None
    started = time.perf_counter()
    with t.guards.long_operation("inprocess_join"):
        _warm_up(t)
        ip.membership.request_join()
        abort_group(t)  # the side round's group: this worker alone until now
        deadline = time.monotonic() + t.cfg.elastic.inprocess_join_timeout_seconds
        # The ticket's head may die before the admission (a join during a recovery):
        # the group's new rank 0 answers then, at the address the marker names.
        gen = ip.membership.await_admission(
            after=ticket.generation, deadline=deadline,
            head=lambda: answers(ticket.host, ticket.ping_port, timeout=ip.probe_seconds)
            or ip.membership.marker_answers(timeout=ip.probe_seconds),
        )  # fmt: skip
        admitted = time.perf_counter()
        _, timings = regroup(t, first=gen, joining=True, heal=heal.wanted(t))
    log.info(
        "inprocess_joined", step=t.step, world_size=t.ctx.world_size, rank=t.ctx.rank,
        generation=gen.number, waited_s=round(admitted - started, 4),
        seconds=round(time.perf_counter() - admitted, 4), **timings,
    )  # fmt: skip


def _warm_up(t: Trainer) -> None:
    """One forward and backward of one sample through the joiner's wrapper, on its
    side round's group of one, before it asks to join; the gradient is dropped.

    A model's first step pays for lazy set-up: autograd's threads, the allocator,
    DDP's first iteration, a compile. Paid in the joiner's first step in the
    group, it stalls every member (22 ms and up on the benchmark MLP, 0.1-0.8 s
    seen on a loaded box); paid here, it delays only the joiner. Its weights,
    buffers and RNG are overwritten by the members' state afterwards.
    """
    started = time.perf_counter()
    with t.precision.autocast():
        total, _ = t.loss.micro_batch(t.ddp, t.batches([0]), 1)
    t.precision.backward(total)
    t.optimizer.zero_grad(set_to_none=True)
    log.info("inprocess_join_warmed", seconds=round(time.perf_counter() - started, 4))


def at_step_boundary(t: Trainer, *, stopping: bool) -> None:
    """After each completed step: rank 0 keeps the marker and the watch current, and
    every member admits the waiting joiners when the last check step said so, unless
    the group is stopping (a preemption: the joiners then go to the rendezvous)."""
    ip = t.inprocess
    if ip is None:
        return
    gen = ip.membership.current
    assert gen is not None
    if gen.rank == 0:
        if ip.published != gen.number:
            _publish(ip)
        if ip.joins is None:
            ip.joins = JoinWatch(ip.membership)
    elif ip.joins is not None:
        ip.joins.close()
        ip.joins = None
    if ip.forming is not None:
        if stopping:  # the joiners go to the rendezvous with the rest
            settle_formation(ip)
        elif ip.forming_verdict == "ready":
            switch(t)
        elif ip.forming_verdict == "failed":
            recover(t, f"the next group did not form: {ip.forming.error}")
    elif ip.admit_due and not stopping:
        if next_group.available(t.ctx.backend):
            begin(t)
        else:
            admit(t)
    ip.admit_due = False


def _publish(ip: InProcess) -> None:
    try:
        ip.membership.publish_active()
        ip.published = ip.membership.current.number  # type: ignore[union-attr]
    except ElasticTrainError as exc:  # joins go through a full restart meanwhile
        log.warning("inprocess_marker_not_published", error=str(exc))


def begin(t: Trainer) -> None:
    """Every member, at the same step: start forming generation ``g + 1`` with the
    joiners in the background (:mod:`.next_group`); :func:`switch` takes it."""
    ip = t.inprocess
    assert ip is not None
    joiners = ip.joins.admissible(probe_timeout=ip.probe_seconds) if ip.joins else []
    ip.forming = next_group.Formation(
        ip.membership, joiners, propose=t.ctx.rank == 0, probe_timeout=ip.probe_seconds,
        timeout=min(ip.pg_timeout_seconds, next_group.FORMATION_TIMEOUT_S),
        op_timeout=ip.pg_timeout_seconds,
    )  # fmt: skip
    ip.forming_verdict = None
    ip.forming_step = t.step
    t.guards.preemption.resync()  # check after the next step, not the scheduled one


def switch(t: Trainer) -> None:
    """Every member, at the same step: the next group is formed on all of them; make
    it the default group, bring the joiners the state, rebuild."""
    ip = t.inprocess
    assert ip is not None and ip.forming is not None
    forming, ip.forming, ip.forming_verdict = ip.forming, None, None
    started, began = time.perf_counter(), time.time()
    old_world, old_ids = t.ctx.world_size, frozenset(m.id for m in forming.members)
    gen, background = forming.gen, forming.seconds
    assert gen is not None
    failure = None
    with t.guards.long_operation("inprocess_admission"):
        try:  # regroup takes the group from the formation: no frame here holds it
            _, timings = regroup(t, first=gen, planned=True, formed=forming,
                                 heal=heal.wanted(t))  # fmt: skip
        except RuntimeError as exc:  # torch's DistError: someone died since it connected
            failure = f"{type(exc).__name__}: {exc}"
    if failure is not None:  # out of the except block, whose frames hold the broken group
        forming.drop()  # its group, if the failure came before regroup took it
        recover(t, failure)
        return
    _admitted(t, gen, old_world=old_world, old_ids=old_ids, started=started, began=began,
              **timings, **background, steps_while_forming=t.step - ip.forming_step)  # fmt: skip


def admit(t: Trainer) -> None:
    """Every member, at the same step: form generation ``g + 1`` with the joiners."""
    ip = t.inprocess
    assert ip is not None
    started, began = time.perf_counter(), time.time()
    old_world, old_ids = t.ctx.world_size, ip.membership.current.ids  # type: ignore[union-attr]
    joiners: list[Member] = []
    if ip.joins is not None:
        joiners = ip.joins.admissible(probe_timeout=ip.probe_seconds)
    try:
        with t.guards.long_operation("inprocess_admission"):
            deadline = time.monotonic() + ip.pg_timeout_seconds
            gen = ip.membership.admit(joiners, propose=t.ctx.rank == 0, deadline=deadline)
            if t.ctx.rank == 0:
                ip.membership.withdraw_requests(joiners)
            _, timings = regroup(t, first=gen, planned=True)
    except MemberLostError as exc:  # rank 0 died before it proposed: a failure like any
        recover(t, f"{type(exc).__name__}: {exc}")
        return
    _admitted(t, gen, old_world=old_world, old_ids=old_ids, started=started, began=began,
              **timings)  # fmt: skip


def _admitted(
    t: Trainer, gen: Generation, *, old_world: int, old_ids: frozenset[str], started: float,
    began: float, **extra: Any,
) -> None:  # fmt: skip
    """The metric and the log line of an admission; ``extra``: its timings."""
    t.metrics.regrouped(cause="join", started_at=began, nodes=gen.nodes)
    log.info(
        "inprocess_admitted", step=t.step, generation=gen.number,
        joiners=[m.id for m in gen.members if m.id not in old_ids], world_size=t.ctx.world_size,
        old_world_size=old_world, seconds=round(time.perf_counter() - started, 4), **extra,
    )  # fmt: skip
