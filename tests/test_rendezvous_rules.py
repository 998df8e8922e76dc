"""The rules of ``elastic_train.rendezvous.rules``, with real handlers against a real etcd.

Each test is built so that torch's own semantics would fail it: the dead node's
heartbeat would only expire after minutes, and idle agents would rewrite the
state every second.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.elastic.events as torch_events
import torch.distributed.elastic.events.handlers as torch_event_handlers
from rendezvous_threads import etcd_requests, join_all, kill, make_handlers, poll_until
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.api import (
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
)

from elastic_train.etcd.client import EtcdClient, EtcdClientConfig
from elastic_train.etcd.server import EtcdServer

#: A dead node would be pruned after 30 s x 3: far beyond every deadline below.
SLOW_PRUNING = {"keep_alive_interval": 30, "keep_alive_max_attempt": 3}


pytestmark = pytest.mark.usefixtures("rendezvous_handlers")


def _handlers(endpoint: str, count: int, **conf: object) -> list[RendezvousHandler]:
    min_nodes = int(conf.pop("min_nodes", 2))  # type: ignore[call-overload]
    max_nodes = int(conf.pop("max_nodes", count))  # type: ignore[call-overload]
    return make_handlers(  # type: ignore[return-value]
        endpoint, count, run_prefix="rules", min_nodes=min_nodes, max_nodes=max_nodes, **conf
    )


def _poll(condition: Callable[[], bool], *, within: float, what: str) -> None:
    poll_until(condition, within=within, what=what, every=0.05)


def test_survivors_re_form_without_waiting_for_the_dead_nodes_heartbeat(
    etcd_endpoint: str,
) -> None:
    a, b, dead = _handlers(etcd_endpoint, 3, **SLOW_PRUNING)
    assert sorted(join_all([a, b, dead], within=30)) == [(0, 3), (1, 3), (2, 3)]
    # `dead` never calls again (its agent was SIGKILLed). With torch's rule the
    # survivors would wait 90 s for its heartbeat to expire.
    assert sorted(join_all([a, b], within=15)) == [(0, 2), (1, 2)]


def test_an_agent_whose_workers_still_run_learns_that_its_round_ended(
    etcd_endpoint: str,
) -> None:
    first, second = _handlers(etcd_endpoint, 2, **SLOW_PRUNING)
    join_all([first, second], within=30)
    assert second.num_nodes_waiting() == 0
    restarting = threading.Thread(target=first.next_rendezvous, daemon=True)
    restarting.start()  # first's workers failed; second's have not noticed yet
    _poll(lambda: second.num_nodes_waiting() >= 1, within=5, what="second sees its round end")
    second_info = second.next_rendezvous()
    restarting.join(15)
    assert not restarting.is_alive()
    assert second_info.world_size == 2


def _state(handler: RendezvousHandler) -> Any:
    handler._state_holder.sync()  # type: ignore[attr-defined]
    return handler._state_holder.state  # type: ignore[attr-defined]


def test_a_job_whose_nodes_all_died_restarts(etcd_endpoint: str) -> None:
    # No survivor is left to end the round (rule 1); the newcomer, waiting,
    # makes the silent participant prove it is alive, and prunes it.
    old, new = _handlers(etcd_endpoint, 2, min_nodes=1, keep_alive_interval=1)
    join_all([old], within=30)
    kill(old)
    assert join_all([new], within=20) == [(0, 1)]


def test_a_spare_node_does_not_end_a_live_round(etcd_endpoint: str) -> None:
    live, spare = _handlers(etcd_endpoint, 2, min_nodes=1, max_nodes=1, keep_alive_interval=1)
    join_all([live], within=30)
    outcome: list[BaseException] = []

    def wait_as_spare() -> None:
        try:
            spare.next_rendezvous()
        except RendezvousError as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=wait_as_spare, daemon=True)
    waiting.start()
    _poll(lambda: bool(_state(live).redundancy_list), within=5, what="the spare is listed")
    # Longer than the 3 s after which a silent participant would be pruned.
    end = time.monotonic() + 5
    while time.monotonic() < end:
        state = _state(live)
        assert state.complete and len(state.participants) == 1, "the live round was ended"
        assert live.num_nodes_waiting() == 0  # a spare is not a reason to restart
        time.sleep(0.2)
    assert waiting.is_alive()
    live.shutdown()  # closes the rendezvous: the spare gives up
    waiting.join(15)
    assert not waiting.is_alive()
    assert [type(e) for e in outcome] == [RendezvousGracefulExitError]


def test_a_joining_node_heartbeats_without_rewriting_the_state(etcd_endpoint: str) -> None:
    # Rule 3. torch would rewrite the shared state for each heartbeat; with 64
    # joining agents those writes starved the joins.
    first, second = _handlers(etcd_endpoint, 2, keep_alive_interval=1)
    client = EtcdClient(EtcdClientConfig(endpoints=(etcd_endpoint,)))
    prefix = f"/elastic_train/{first.get_run_id()}"
    first_info: list[Any] = []
    joining = threading.Thread(
        target=lambda: first_info.append(first.next_rendezvous()), daemon=True
    )
    joining.start()  # alone below min_nodes=2: it waits, heartbeating
    _poll(lambda: client.get(f"{prefix}/state".encode())[0] is not None, within=10, what="join")
    revision = client.get(f"{prefix}/state".encode())[0].mod_revision  # type: ignore[union-attr]
    beats: set[int] = set()
    # Longer than the 3 s after which a node is pruned when its heartbeats stop.
    end = time.monotonic() + 3.5
    while time.monotonic() < end:
        beats |= {kv.mod_revision for kv in client.get_prefix(f"{prefix}/heartbeats/".encode())[0]}
        time.sleep(0.2)
    assert client.get(f"{prefix}/state".encode())[0].mod_revision == revision  # type: ignore[union-attr]
    assert len(beats) >= 3, f"heartbeat key revisions seen in 3.5 s: {sorted(beats)}"
    (second_rank,) = join_all([second], within=15)  # first was not pruned: a round of 2
    joining.join(15)
    assert {(first_info[0].rank, first_info[0].world_size), second_rank} == {(0, 2), (1, 2)}
    first.shutdown()
    second.shutdown()
    assert client.get_prefix(f"{prefix}/heartbeats/".encode())[0] == [], "a key outlived its node"
    client.close()


def test_rendezvous_events_keep_the_names_torch_gives_them(
    etcd_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ours name them from the calling frame; torch's inspect.stack() took
    # milliseconds per action even with no event handler configured.
    messages: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    monkeypatch.setitem(torch_event_handlers._log_handlers, "dynamic_rendezvous", Capture())
    try:
        (only,) = _handlers(etcd_endpoint, 1, min_nodes=1)
        join_all([only], within=30)
    finally:
        torch_events._events_loggers.pop("dynamic_rendezvous", None)
        logging.getLogger("torchelastic-events-dynamic_rendezvous").handlers.clear()
    events = [json.loads(m) for m in messages]
    names = {e["name"].split(":", 1)[1] for e in events}
    assert {
        "EtcdV3RendezvousHandler.next_rendezvous",
        "FastOpExecutor._add_to_participants",
        "FastOpExecutor._mark_rendezvous_complete",
    } <= names, names
    assert {e["pid"] for e in events} == {only._this_node.pid}  # type: ignore[attr-defined]


def test_idle_agents_send_etcd_nothing(tmp_path: Path) -> None:
    server = EtcdServer(data_dir=tmp_path / "data", name="idle").start()
    try:
        handlers = _handlers(server.endpoint, 2, keep_alive_interval=1)
        join_all(handlers, within=30)
        key = f"/elastic_train/{handlers[0].get_run_id()}/state".encode()
        client = EtcdClient(EtcdClientConfig(endpoints=(server.endpoint,)))
        revision = client.get(key)[0].mod_revision  # type: ignore[union-attr]
        before = etcd_requests(server)
        # torchrun's monitor loop asks every 0.1 s; torch's handler would also
        # rewrite the state once per keep_alive_interval (1 s here).
        end = time.monotonic() + 3.5
        while time.monotonic() < end:
            assert [h.num_nodes_waiting() for h in handlers] == [0, 0]
            time.sleep(0.1)
        requests = etcd_requests(server) - before
        assert client.get(key)[0].mod_revision == revision  # type: ignore[union-attr]
        assert requests <= 1, f"{requests} etcd requests from 2 idle agents in 3.5 s"
        client.close()
    finally:
        server.stop()


def test_an_agent_stopped_by_a_signal_leaves_without_closing_the_rendezvous(
    etcd_endpoint: str,
) -> None:
    """torch 2.6 calls shutdown() while handling a SIGTERM's SignalException: the
    preempted node must leave, not close the rendezvous on the survivors."""
    signalled, survivor, finished = _handlers(etcd_endpoint, 3, min_nodes=1, keep_alive_interval=1)
    try:
        raise SignalException("SIGTERM", sigval=signal.SIGTERM)
    except SignalException:
        assert signalled.shutdown()
    assert not survivor.is_closed()
    assert finished.shutdown()  # an agent that ends normally still closes it for everyone
    # The survivor reads a watched copy of the state: the close arrives by watch.
    _poll(survivor.is_closed, within=10, what="the survivor sees the closed rendezvous")
