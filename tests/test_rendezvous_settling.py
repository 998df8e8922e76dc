"""A round settles until its workers formed their group (``rendezvous/settling.py``):
a node that dies before that ends the round for the others, and a settled round is
idle again (rule 2 of ``rendezvous/rules.py``). Real handlers, a real etcd.

Without settling, a node that died between the round and the first group went
unnoticed until the survivors' workers timed out at their store (57 s measured;
``pg_timeout_seconds``): the first test would wait for the round to end forever.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from rendezvous_threads import etcd_requests, join_all, kill, make_handlers, poll_until

from elastic_train.etcd.server import EtcdServer
from elastic_train.rendezvous.backend import EtcdV3RendezvousHandler
from elastic_train.rendezvous.settling import Settling

pytestmark = pytest.mark.usefixtures("rendezvous_handlers")

#: keep_alive_interval 1 s x keep_alive_max_attempt 3: a silent node is dead after 3 s
EXPIRY_S = 3.0


def _settling(endpoint: str, count: int, formed: list[bool]) -> list[EtcdV3RendezvousHandler]:
    """``count`` handlers whose workers formed their group when ``formed[i]`` says so."""
    handlers = make_handlers(
        endpoint, count, run_prefix="settle", min_nodes=1, max_nodes=count, keep_alive_interval=1
    )
    for i, handler in enumerate(handlers):
        handler.settle_until(lambda round_, i=i: formed[i])
    return handlers


def test_a_node_dead_before_the_group_formed_ends_the_round_for_the_others(
    etcd_endpoint: str,
) -> None:
    a, b, dead = _settling(etcd_endpoint, 3, formed=[False] * 3)
    assert sorted(join_all([a, b, dead], within=30)) == [(0, 3), (1, 3), (2, 3)]
    killed = time.monotonic()
    kill(dead)  # its workers never reach the group; the others' wait at the store
    poll_until(
        lambda: a.num_nodes_waiting() >= 1 and b.num_nodes_waiting() >= 1,
        within=EXPIRY_S + 7, what="the survivors see their round end",
    )  # fmt: skip
    # Judged dead after its heartbeats stopped for the expiry, not before.
    assert time.monotonic() - killed >= EXPIRY_S - 1.0
    assert sorted(join_all([a, b], within=15)) == [(0, 2), (1, 2)]


def test_a_settled_round_is_idle_again(tmp_path: Path) -> None:
    """Once the workers formed the group (and the grace passed), the agents are silent
    again and a silent node is nobody's concern: rule 1 and the workers' collectives
    take over."""
    server = EtcdServer(data_dir=tmp_path / "data", name="settled").start()
    try:
        formed = [False, False]
        handlers = _settling(server.endpoint, 2, formed)
        join_all(handlers, within=30)
        formed[:] = [True, True]
        poll_until(
            lambda: not any(h._settles(h._state_holder.state, judging=False) for h in handlers),
            within=EXPIRY_S + 5, what="both rounds settled",
        )  # fmt: skip
        kill(handlers[1])
        before = etcd_requests(server)
        end = time.monotonic() + EXPIRY_S + 2
        while time.monotonic() < end:
            assert handlers[0].num_nodes_waiting() == 0, "a settled round was ended"
            time.sleep(0.1)
        requests = etcd_requests(server) - before
        assert requests <= 1, f"{requests} etcd requests from a settled agent in 5 s"
    finally:
        server.stop()


def test_a_round_forms_until_the_workers_say_so_then_beats_a_grace_or_ends_at_its_limit() -> None:
    formed = threading.Event()
    settling = Settling(lambda round_: formed.is_set(), grace=0.3, limit=1.0)
    assert settling.judging(4) and settling.beating(4)  # its first sight of round 4
    assert not settling.beating(3)  # an older round is over
    formed.set()
    # The workers formed the group: no more judging, but beats for the grace.
    assert not settling.judging(4) and settling.beating(4)
    poll_until(lambda: not settling.beating(4), within=2, what="settled after the grace")
    formed.clear()
    assert not settling.beating(4)  # and it stays settled
    started = time.monotonic()
    assert settling.judging(5)  # the workers of the next round never report
    poll_until(lambda: not settling.judging(5), within=3, what="settled at the limit")
    assert time.monotonic() - started >= 1.0 and not settling.beating(5)
