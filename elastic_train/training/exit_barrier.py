"""torchrun's exit barrier after an in-process shrink: arrive for the agents that left.

Once its workers succeed, torchrun's agent waits in an exit barrier
(``SimpleElasticAgent._exit_barrier``, torch 2.6 to 2.13: ``store_util.barrier``
on the round's store, key prefix ``torchelastic/agent/terminal_state``, 300 s)
until every agent of its last rendezvous round has arrived: each adds 1 to
``.../num_members`` and the one that makes it the round's agent count sets
``.../last_member``, which the others wait for. With ``elastic.recovery =
"inprocess"`` a node that died was removed without a new round, so its agent
never arrives and the survivors' agents linger the full 300 s after a
successful finish (then exit 0: the barrier's timeout is only logged).

:func:`release_departed` arrives for them: at a successful finish after one or
more in-process shrinks, the final rank 0 adds the number of departed agents
(the round's agents minus the nodes of the final generation that came from
the round: a node admitted by an async join has an agent in a side round of
its own, ``rendezvous/side_round.py``) to the counter,
and sets the last-member key if that completes the barrier. It writes through
an :class:`~elastic_train.etcd.store.EtcdV3Store` inside the same
``PrefixStore`` the agents use, so key and signature match theirs. A marker key
created if absent makes a second release in the same round a no-op; a
departed agent that arrives after all finds the count past the barrier's size
and the last-member key set, and passes. Without a shrink (generation 0, or
``recovery = "restart"``) nothing is written: a barrier is never passed for an
agent that is still part of the job.

The torchrun plugin tells the workers where the round's store is
(:data:`EXIT_BARRIER_ENV`); etcd access and the job secret come the way the
membership's do (:class:`~elastic_train.training.etcd_access.EtcdAccess`).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from elastic_train.errors import ElasticTrainError
from elastic_train.etcd.store import EtcdV3Store
from elastic_train.log import get_logger
from elastic_train.training.etcd_access import json_from_env

if TYPE_CHECKING:
    from elastic_train.training.etcd_access import EtcdAccess
    from elastic_train.training.membership import Membership

log = get_logger(__name__)

#: Set by the torchrun plugin for every round the agent joins (the workers it
#: spawns next inherit it): where that round's store is, as JSON. No secret.
EXIT_BARRIER_ENV = "ELASTIC_TRAIN_EXIT_BARRIER"
#: torch's ``_TERMINAL_STATE_SYNC_ID`` and ``store_util``'s suffixes (2.6 to 2.13).
TERMINAL_STATE = "torchelastic/agent/terminal_state"
NUM_MEMBERS = f"{TERMINAL_STATE}/num_members"
LAST_MEMBER = f"{TERMINAL_STATE}/last_member"
#: Created if absent by the one release a round gets (outside torch's keys).
RELEASED = "elastic_train/exit_barrier/released"


@dataclass(frozen=True)
class RoundStore:
    """Where one rendezvous round's store is: the JSON of :data:`EXIT_BARRIER_ENV`."""

    store: str  # etcd prefix of the rendezvous' EtcdV3Store: {key_prefix}/{run_id}/store
    round: str  # torch's PrefixStore of the round: torch.rendezvous.{run_id}.{round}
    agents: int  # the round's agents: the exit barrier's size
    ttl: int  # seconds: the lease of the rendezvous' keys (rdzv-conf ttl)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RoundStore | None:
        """The round this worker's agent joined; None when not started by our plugin."""
        return json_from_env(EXIT_BARRIER_ENV, lambda fields: cls(**fields), environ)

    @contextmanager
    def opened(self, access: EtcdAccess) -> Iterator[dist.Store]:
        """The round's store as the agents see it: the same key prefixes, the job's codec."""
        client = access.client()
        try:
            etcd = EtcdV3Store(client, self.store, codec=access.codec(), lease_ttl=self.ttl)
            # ``etcd`` must outlive the PrefixStore: the C++ side does not keep the
            # Python object, and without it every call fails ("Not implemented").
            yield dist.PrefixStore(self.round, etcd)
        finally:
            client.close()


def release_departed(store: dist.Store, *, agents: int, present: int) -> int:
    """Arrive at the exit barrier of ``store`` for the ``agents - present`` agents that
    left; returns how many were added (0: none left, or released already)."""
    departed = agents - present
    if departed <= 0:
        return 0
    token = uuid.uuid4().hex
    if store.compare_set(RELEASED, "", token) != token.encode():
        return 0
    count = store.add(NUM_MEMBERS, departed)
    if count >= agents:
        # torch's last arrival sets it only when its own add lands on ``agents``
        # exactly; this add may have stepped past that.
        store.set(LAST_MEMBER, "<val_ignored>")
    log.info(
        "exit_barrier_released", agents=agents, present=present, departed=departed, count=count
    )
    return departed


def release_after_shrink(membership: Membership | None) -> None:
    """The final rank 0's call at a successful finish (``membership``: in-process
    recovery's, None when off): release the exit barrier for the nodes that
    in-process recovery left behind. Never raises: without it the agents wait out
    torch's timeout, as before."""
    generation = membership.current if membership is not None else None
    if membership is None or generation is None or generation.number == 0:
        return  # no shrink: every agent of the round arrives by itself
    try:
        round_store = RoundStore.from_env()
        if round_store is None:
            log.warning("exit_barrier_not_released", reason=f"{EXIT_BARRIER_ENV} is not set")
            return
        with round_store.opened(membership.access) as store:
            release_departed(store, agents=round_store.agents, present=generation.round_nodes)
    except (ElasticTrainError, RuntimeError, ValueError, OSError) as exc:  # RuntimeError: torch
        log.warning("exit_barrier_not_released", reason=f"{type(exc).__name__}: {exc}")
