"""torchrun's exit barrier after an in-process shrink (``training/exit_barrier.py``).

Real etcd, real rendezvous handlers (one per "agent", in threads) and torch's own
barrier function, the one ``SimpleElasticAgent._exit_barrier`` calls:

- the plugin exports the store of the round its handler joined, and a worker's
  store built from that export reaches the same keys with the same signatures
  as the agents' (a value written by one is read by the other);
- a barrier of 3 agents that one departed completes when the final rank 0
  releases it, not before; the departed agent arriving after all passes at
  once; a second release adds nothing;
- no shrink, no write: a barrier whose agents are all present, and a worker
  still at generation 0, leave the store untouched.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist
from rendezvous_threads import poll_until
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.utils import store as store_util

from elastic_train.errors import ConfigError
from elastic_train.rendezvous import backend as rendezvous
from elastic_train.rendezvous.backend import EtcdV3RendezvousHandler
from elastic_train.torchrun_plugin import EXIT_BARRIER_ENV as PLUGIN_ENV
from elastic_train.torchrun_plugin import export_rounds, inprocess_etcd_env
from elastic_train.training.etcd_access import ETCD_ENV, EtcdAccess
from elastic_train.training.exit_barrier import (
    EXIT_BARRIER_ENV,
    LAST_MEMBER,
    NUM_MEMBERS,
    RELEASED,
    TERMINAL_STATE,
    RoundStore,
    release_after_shrink,
    release_departed,
)
from elastic_train.training.membership import Membership


@dataclass
class Round:
    """One completed rendezvous round of ``len(infos)`` agents, and the worker's view."""

    handlers: list[EtcdV3RendezvousHandler]
    infos: list[RendezvousInfo]
    exported: RoundStore
    access: EtcdAccess


def _join(handlers: list[EtcdV3RendezvousHandler], *, within: float) -> list[RendezvousInfo]:
    """Every handler's next round, joined at once as separate agents would."""
    infos: list[RendezvousInfo | BaseException | None] = [None] * len(handlers)

    def join(i: int) -> None:
        try:
            infos[i] = handlers[i].next_rendezvous()
        except BaseException as exc:
            infos[i] = exc

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(within)
    for info in infos:
        if isinstance(info, BaseException):
            raise info
    assert all(info is not None for info in infos), f"no round within {within} s"
    return infos  # type: ignore[return-value]


@pytest.fixture
def three_agents(
    etcd_endpoint: str, rdzv_secret_file: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Round]:
    """A round of 3 agents whose handlers export it as the torchrun plugin's do."""
    monkeypatch.setenv(EXIT_BARRIER_ENV, "")  # restored (removed) after the test
    params = RendezvousParameters(
        "etcd-v3", etcd_endpoint, f"exitb-{uuid.uuid4().hex[:8]}", 3, 3,
        last_call_timeout=1, secret_file=str(rdzv_secret_file),
    )  # fmt: skip
    handlers = [rendezvous.create_handler(params) for _ in range(3)]
    for handler in handlers:
        export_rounds(handler, params)
    try:
        infos = _join(handlers, within=60)
        exported = RoundStore.from_env()
        assert exported is not None
        access = EtcdAccess.from_env({ETCD_ENV: inprocess_etcd_env(params)})
        yield Round(handlers, infos, exported, access)
    finally:
        for handler in handlers:
            handler.shutdown()


def _arrive(store: dist.Store, *, agents: int, timeout: float) -> threading.Thread:
    """An agent entering torch's exit barrier, as ``SimpleElasticAgent._exit_barrier`` does."""

    def wait() -> None:
        store_util.barrier(
            store=store, world_size=agents, key_prefix=TERMINAL_STATE, barrier_timeout=timeout
        )

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def test_the_worker_reaches_the_round_store_of_the_agents(
    three_agents: Round, rdzv_secret_file: Path
) -> None:
    assert PLUGIN_ENV == EXIT_BARRIER_ENV
    assert rdzv_secret_file.read_text().strip() not in os.environ[EXIT_BARRIER_ENV]
    r = three_agents
    assert r.exported.agents == 3 == r.infos[0].world_size
    assert r.exported.round.startswith("torch.rendezvous.")
    with r.exported.opened(r.access) as store:
        r.infos[1].store.set("probe/agent", "from the agent")
        assert store.get("probe/agent") == b"from the agent"
        store.set("probe/worker", "from the worker")
        assert r.infos[2].store.get("probe/worker") == b"from the worker"


def _count(store: dist.Store) -> int:
    """The barrier's arrivals so far (read only)."""
    return int(store.get(NUM_MEMBERS)) if store.check([NUM_MEMBERS]) else 0


def test_a_barrier_of_three_with_one_departed_completes_when_released(
    three_agents: Round,
) -> None:
    r = three_agents
    survivors = [_arrive(info.store, agents=3, timeout=120) for info in r.infos[:2]]
    with r.exported.opened(r.access) as store:
        poll_until(lambda: _count(store) == 2, within=30, what="both survivors in the barrier")
        assert all(t.is_alive() for t in survivors) and not store.check([LAST_MEMBER])

        assert release_departed(store, agents=3, present=2) == 1
        for thread in survivors:
            thread.join(30)
        assert not any(t.is_alive() for t in survivors), "the barrier did not complete"
        # Released once per round: a second call (any rank, any retry) adds nothing.
        assert release_departed(store, agents=3, present=2) == 0
        assert _count(store) == 3
        # The departed agent arriving after all passes at once (its add lands past 3).
        late = _arrive(r.infos[2].store, agents=3, timeout=5)
        late.join(30)
        assert not late.is_alive()
        assert _count(store) == 4


def test_only_a_shrink_releases_and_by_the_nodes_it_lost(
    three_agents: Round, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = three_agents
    monkeypatch.setenv(ETCD_ENV, r.access.to_env())
    membership = Membership(r.access, lineage=uuid.uuid4().hex, node="node0", host="127.0.0.1")
    try:
        with r.exported.opened(r.access) as store:
            # No shrink: every agent arrives by itself, so nothing is written.
            assert release_departed(store, agents=3, present=3) == 0
            release_after_shrink(None)  # recovery = "restart"
            release_after_shrink(membership)  # not registered yet
            membership.register(rank=0, world_size=1, deadline=float("inf"))
            release_after_shrink(membership)  # generation 0: the group torchrun formed
            assert not any(store.check([key]) for key in (NUM_MEMBERS, RELEASED, LAST_MEMBER))

            # Generation 1 holds node0 alone: the round's other 2 agents departed.
            assert membership.agree(probe_timeout=1.0).nodes == 1
            release_after_shrink(membership)
            assert _count(store) == 2 and not store.check([LAST_MEMBER])
            survivor = _arrive(r.infos[0].store, agents=3, timeout=120)
            survivor.join(30)
            assert not survivor.is_alive(), "the survivor's barrier did not complete"
    finally:
        membership.close()


def test_a_malformed_export_names_the_variable() -> None:
    assert RoundStore.from_env({}) is None  # not started by our plugin: nothing to release
    with pytest.raises(ConfigError, match=EXIT_BARRIER_ENV):
        RoundStore.from_env({EXIT_BARRIER_ENV: '{"store": "/x/store"}'})
