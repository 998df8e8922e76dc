"""The next in-process group, formed while the members keep training (#20 item 2).

Rebuilding torch's default group at an admission stalled the members for the
etcd admission, the wait at the new generation's store for the slowest member
and gloo's connections: most of a join's stall (benchmarks/README.md, "The
next group formed in the background"). Here a thread does all of that while
the members step on the current group; the switch, at a step boundary every
member reaches with the new group ready (``step.Agreement`` counts them), only
installs it as the default group, moves the state to the joiners and rebuilds.

Only gloo, and only on a torch whose group registry this module knows
(:func:`available`: 2.6-2.13, checked on 2.6 with ``bash .ci/torch-floor``;
in-process recovery itself needs 2.8, ``recovery_mode.py``): anywhere else
the admission forms the group at the boundary as before. The group is built the way torch's
``_new_process_group_helper`` builds a default gloo group, but not registered
until the switch, so a formation that is dropped (a failure meanwhile, a stop)
leaves torch's registry untouched: the object is released, nothing else.

Every in-process group after the first is formed this way on such a torch
(:func:`form`, also in a failure's re-form and on a joiner): members and
joiners must name the group alike, since the name prefixes gloo's keys.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from elastic_train.log import get_logger
from elastic_train.training.membership import Generation, Member, Membership

log = get_logger(__name__)

_BACKEND = "gloo"
#: Seconds a formation may take: the members start it at the same step and the
#: joiners wait for it, so it ends in milliseconds; one that fails or times out
#: costs a re-form at the boundary, and a failure meanwhile waits this long at most.
FORMATION_TIMEOUT_S = 10.0


def available(backend: str) -> bool:
    """Whether groups of ``backend`` can be formed here and registered later."""
    needed = ("_update_default_pg", "BackendConfig", "Backend", "_world")
    registry = hasattr(c10d, "_register_pg_in_world") or hasattr(c10d, "_register_process_group")
    return (
        backend == _BACKEND
        and dist.is_gloo_available()
        and registry
        and all(hasattr(c10d, name) for name in needed)
        and all(
            hasattr(dist.ProcessGroup, name)
            for name in ("_register_backend", "_set_group_name", "_set_group_desc")
        )
    )


def group_name(gen: Generation) -> str:
    return f"inprocess-g{gen.number}"


@dataclass(frozen=True)
class NewGroup:
    """A formed group and the store it was formed on (its registry entry needs both)."""

    group: dist.ProcessGroup
    store: dist.Store


def form(
    store: dist.Store, gen: Generation, *, timeout: float, op_timeout: float | None = None
) -> NewGroup:
    """Generation ``gen``'s gloo group on ``store``, connected, known to no registry.
    ``timeout`` bounds the connection; ``op_timeout`` (default: the same) each
    collective after it.

    The steps of torch's ``_new_process_group_helper`` for a default gloo group
    (torch 2.13), registration left to :func:`install`."""
    name = group_name(gen)
    prefix_store = dist.PrefixStore(f"{name}/", store)
    group = dist.ProcessGroup(prefix_store, gen.rank, gen.world_size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    gloo = dist.ProcessGroupGloo(
        dist.PrefixStore(f"{_BACKEND}/", prefix_store), gen.rank, gen.world_size,
        timedelta(seconds=timeout),
    )  # fmt: skip
    gloo._set_sequence_number_for_group()
    if op_timeout is not None and hasattr(gloo, "_set_default_timeout"):
        gloo._set_default_timeout(timedelta(seconds=op_timeout))
    config = c10d.BackendConfig(c10d.Backend(_BACKEND))
    for device in config.get_device_backend_map():
        group._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_group_name(name)
    group._set_group_desc("default_pg")
    return NewGroup(group, prefix_store)


def install(new: NewGroup) -> None:
    """Make ``new`` torch's default group, registered as ``init_process_group`` does."""
    assert not dist.is_initialized(), "destroy the old default group first"
    backend = c10d.Backend(_BACKEND)
    ranks = {rank: rank for rank in range(new.group.size())}
    if hasattr(c10d, "_register_pg_in_world"):  # torch >= 2.13
        c10d._register_pg_in_world(
            new.group, backend_name=backend, store=new.store, group_name=new.group.group_name,
            backend_config=str(c10d.BackendConfig(backend)), rank_mapping=ranks,
            add_to_default_tag=True,
        )  # fmt: skip
    else:
        _register_before_2_13(new, backend)
        c10d._world.pg_group_ranks[new.group] = ranks
    c10d._update_default_pg(new.group)


def _register_before_2_13(new: NewGroup, backend: str) -> None:
    """What ``_new_process_group_helper`` of torch 2.6-2.12 writes into the
    registry for a default group, which 2.13 moved into ``_register_pg_in_world``."""
    world, group, name = c10d._world, new.group, new.group.group_name
    world.pg_map[group] = (backend, new.store)
    world.pg_names[group] = name
    c10d._register_process_group(name, group)
    world.pg_backend_config[group] = str(c10d.BackendConfig(backend))
    tag = f"ptd:{name}"
    world.tags_to_pg.setdefault("", []).append(group)
    world.tags_to_pg.setdefault(tag, []).append(group)
    world.pg_to_tag[group] = tag


def release(holder: list[Any]) -> None:
    """Drop the groups in ``holder``, its caller's only reference to them: their
    destructors (20-30 ms each of joining gloo's threads, without the GIL) run
    in a thread of their own."""
    if holder:
        threading.Thread(target=holder.clear, name="group-retire", daemon=True).start()


class Formation:
    """A thread that admits ``joiners`` in etcd and forms the new generation's group.

    The members read :attr:`ready` and :attr:`failed` (at check steps) and take
    the result with :meth:`take` at the switch, or :meth:`drop` it."""

    def __init__(
        self, membership: Membership, joiners: list[Member], *, propose: bool,
        timeout: float, op_timeout: float, probe_timeout: float,
    ) -> None:  # fmt: skip
        self._membership, self._joiners, self._propose = membership, joiners, propose
        self._op_timeout = op_timeout
        current = membership.current
        assert current is not None
        self.members = current.members  # before the thread adopts the next generation
        self._timeout, self._probe_timeout = timeout, probe_timeout
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._dropped = False
        self.gen: Generation | None = None
        self.group: NewGroup | None = None
        self.error: str | None = None
        self.seconds: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="next-group", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            deadline = time.monotonic() + self._timeout
            gen = self._membership.admit(self._joiners, propose=self._propose, deadline=deadline)
            if self._propose:
                self._membership.withdraw_requests(self._joiners)
            admitted = time.perf_counter()
            store = gen.store(
                self._membership.endpoints, timeout=self._timeout, probe_timeout=self._probe_timeout
            )
            group: NewGroup | None = form(
                store, gen, timeout=self._timeout, op_timeout=self._op_timeout
            )
            assert group is not None
            group.group.barrier().wait()  # pairs with the joiners' (inprocess.form_group)
            self.seconds = {"admission_s": round(admitted - started, 4),
                            "formation_s": round(time.perf_counter() - admitted, 4)}  # fmt: skip
        except Exception as exc:  # etcd's, torch's DistError, MemberLostError: all end the same
            self.error = f"{type(exc).__name__}: {exc}"
            group, gen = None, None
        with self._lock:
            if not self._dropped:
                self.gen, self.group = gen, group
            number = gen.number if gen is not None else None
            del group
            self._done.set()
        # After the verdict is readable: a check step that follows this line sees it.
        if self.error is None:
            log.info("inprocess_next_group_formed", generation=number, **self.seconds)
        else:
            log.warning("inprocess_next_group_failed", error=self.error[:300])

    @property
    def ready(self) -> bool:
        return self._done.is_set() and self.group is not None

    @property
    def failed(self) -> bool:
        return self._done.is_set() and self.group is None

    def take(self) -> tuple[Generation, NewGroup, dict[str, float]]:
        """The formed generation and group (only when :attr:`ready`)."""
        assert self.gen is not None and self.group is not None
        group, self.group = self.group, None
        return self.gen, group, self.seconds

    def finish(self, *, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread; whether it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def drop(self) -> None:
        """Forget the formation: a group formed already, or later, is released unused."""
        with self._lock:
            self._dropped = True
            holder = [self.group] if self.group is not None else []
            self.group = None
        release(holder)
