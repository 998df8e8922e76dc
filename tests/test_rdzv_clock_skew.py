"""A node whose wall clock is off by 10 s is neither evicted nor evicts anyone.

The skewed node is a real process with a real skewed clock: libfaketime
(``apt-get install faketime``) shifts its ``time()``/``datetime.now()`` by
``FAKETIME``; its monotonic clock stays real, as on a host whose NTP is off.
The others are handlers in this process. A spare node waiting for a full round
makes the participants prove they are alive (rule 2), which is when torch's
wall-clock comparison across hosts evicted them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rendezvous_threads import join_all
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousHandler

from elastic_train.rendezvous import backend as rendezvous

NODE_SCRIPT = Path(__file__).parent / "scripts" / "rdzv_node.py"
FAKETIME_LIB = next(
    (
        path
        for path in (
            Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"),
            Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"),
            Path("/usr/lib/faketime/libfaketime.so.1"),
            Path("/usr/local/lib/faketime/libfaketime.so.1"),
        )
        if path.exists()
    ),
    None,
)
SKEW_S = 10
#: Longer than keep_alive_interval x keep_alive_max_attempt (1 s x 3), with margin.
WATCH_S = 6.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        FAKETIME_LIB is None, reason="needs libfaketime: apt-get install -y faketime"
    ),
]


class SkewedNode:
    """tests/scripts/rdzv_node.py under libfaketime: its wall clock is off by ``skew_s``."""

    def __init__(self, out: Path, args: list[str], skew_s: int) -> None:
        self.out = out
        self.log = out / "skewed.jsonl"
        env = {
            **os.environ,
            "LD_PRELOAD": str(FAKETIME_LIB),
            "FAKETIME": f"{skew_s:+d}s",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # a real host's monotonic clock is fine
        }
        with open(self.log, "wb") as stdout, open(out / "skewed.err", "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(NODE_SCRIPT), *args, str(out)],
                stdout=stdout,
                stderr=stderr,
                env=env,
            )

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line]

    def wait_for(self, event: str, within: float) -> dict[str, Any]:
        deadline = time.monotonic() + within
        while True:
            found = [e for e in self.events() if e["event"] == event]
            if found:
                return found[0]
            assert self.proc.poll() is None, (self.out / "skewed.err").read_text()[-3000:]
            assert time.monotonic() < deadline, f"no {event!r} within {within} s"
            time.sleep(0.1)

    def stop(self) -> int:
        (self.out / "stop").touch()
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def run_id(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    return f"skew-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def nodes() -> Iterator[list[SkewedNode]]:
    started: list[SkewedNode] = []
    yield started
    for node in started:
        node.stop()


def _handler(endpoint: str, run_id: str, secret_file: Path) -> RendezvousHandler:
    return rendezvous.create_handler(
        RendezvousParameters(
            "etcd-v3", endpoint, run_id, 2, 2, secret_file=str(secret_file),
            keep_alive_interval=1, keep_alive_max_attempt=3, last_call_timeout=1,
        )
    )  # fmt: skip


def _state(handler: RendezvousHandler) -> Any:
    with handler._heartbeat_lock:  # type: ignore[attr-defined]
        handler._state_holder.sync()  # type: ignore[attr-defined]
        return handler._state_holder.state  # type: ignore[attr-defined]


def _wait_as_spare(handler: RendezvousHandler) -> threading.Thread:
    def wait() -> None:
        with contextlib.suppress(RendezvousError):  # it closes when the test ends
            handler.next_rendezvous()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def _assert_round_kept(observer: RendezvousHandler, members: int, *, round_: int) -> None:
    """For WATCH_S, while a spare waits: the round is the same, complete, all members in."""
    deadline = time.monotonic() + 10
    while not _state(observer).redundancy_list:
        assert time.monotonic() < deadline, "the spare never listed itself"
        time.sleep(0.1)
    end = time.monotonic() + WATCH_S
    while time.monotonic() < end:
        state = _state(observer)
        assert (state.round, state.complete) == (round_, True), "the round was ended"
        assert len(state.participants) == members, "a participant was evicted"
        assert observer.num_nodes_waiting() == 0
        time.sleep(0.2)


def _skew_seen(node: SkewedNode) -> float:
    return node.wait_for("started", within=60)["wall_time"] - time.time()


def test_a_participant_whose_clock_is_10s_behind_is_not_evicted(
    etcd_endpoint: str, run_id: str, rdzv_secret_file: Path, tmp_path: Path, nodes: list
) -> None:
    args = [etcd_endpoint, run_id, "2", "2", str(rdzv_secret_file)]
    skewed = SkewedNode(tmp_path, args, -SKEW_S)
    nodes.append(skewed)
    normal = _handler(etcd_endpoint, run_id, rdzv_secret_file)
    assert join_all([normal], within=60) in ([(0, 2)], [(1, 2)])
    assert _skew_seen(skewed) == pytest.approx(-SKEW_S, abs=2)
    round_ = _state(normal).round
    spare = _handler(etcd_endpoint, run_id, rdzv_secret_file)
    waiting = _wait_as_spare(spare)
    _assert_round_kept(normal, 2, round_=round_)
    events = [e["event"] for e in skewed.events()]
    assert events == ["started", "joined"], "the skewed node was evicted"
    normal.shutdown()  # closes the rendezvous: the spare gives up
    waiting.join(15)
    assert skewed.stop() == 0


def test_a_spare_whose_clock_is_10s_ahead_evicts_nobody(
    etcd_endpoint: str, run_id: str, rdzv_secret_file: Path, tmp_path: Path, nodes: list
) -> None:
    first, second = (_handler(etcd_endpoint, run_id, rdzv_secret_file) for _ in range(2))
    assert sorted(join_all([first, second], within=30)) == [(0, 2), (1, 2)]
    round_ = _state(first).round
    args = [etcd_endpoint, run_id, "2", "2", str(rdzv_secret_file)]
    skewed = SkewedNode(tmp_path, args, +SKEW_S)  # waits as a spare: the round is full
    nodes.append(skewed)
    assert _skew_seen(skewed) == pytest.approx(SKEW_S, abs=2)
    _assert_round_kept(first, 2, round_=round_)
    assert second.num_nodes_waiting() == 0
    first.shutdown()  # closes the rendezvous: the spare gives up
    assert skewed.wait_for("closed", within=30)
    second.shutdown()
