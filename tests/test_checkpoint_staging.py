"""Reused host buffers for asynchronous checkpoints: fast, and never a later step's values."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from elastic_train.errors import CheckpointError
from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.state.staging import HostStaging


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("checkpoint-writer")]


def test_async_saves_never_leak_a_later_step_into_an_earlier_file(tmp_path: Path) -> None:
    # 8 MB, so step 1 is still being written while the loop mutates and saves step 2.
    live = {"w": torch.randn(2_000_000), "b": torch.randn(7), "step": 1}
    expected = {}
    with CheckpointManager(tmp_path, keep=5, fingerprint="fp", is_writer=True) as manager:
        for step in (1, 2, 3):
            live["step"] = step
            manager.save(step, live)
            expected[step] = {"w": live["w"].clone(), "b": live["b"].clone(), "step": step}
            live["w"].mul_(-1.5).add_(step)  # in place, as an optimizer step is
            live["b"].add_(1.0)
        # A structure change (a tensor with a new shape) falls back to a fresh buffer.
        live["b"], live["step"] = torch.randn(9), 4
        manager.save(4, live)
        expected[4] = {"w": live["w"].clone(), "b": live["b"].clone(), "step": 4}
        live["w"].zero_()
        live["b"].zero_()
    reader = CheckpointManager(tmp_path, keep=5, fingerprint="fp", is_writer=False)
    for step, want in expected.items():
        got = reader.load(step, map_location="cpu")
        assert got["step"] == want["step"]
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"]), step


def test_staging_refills_the_same_buffers_while_shapes_match() -> None:
    weight = torch.randn(6, 4)
    state = {"model": {"w": weight, "tied": weight, "t": torch.randn(4, 3).t()}, "lr": 0.1}
    staging = HostStaging()
    first = staging.copy(state)
    assert (staging.allocated, staging.reused) == (2, 0)
    pointers = [first["model"][k].data_ptr() for k in ("w", "t")]
    weight.add_(1.0)
    state["lr"] = 0.2
    second = staging.copy(state)
    assert (staging.allocated, staging.reused) == (0, 2)
    assert [second["model"][k].data_ptr() for k in ("w", "t")] == pointers
    assert torch.equal(second["model"]["w"], weight) and second["lr"] == 0.2
    assert second["model"]["tied"] is second["model"]["w"]  # tied weights stay one tensor
    assert second["model"]["t"].stride() == state["model"]["t"].stride()
    assert torch.equal(second["model"]["t"], state["model"]["t"])


def test_staging_allocates_only_for_tensors_that_changed() -> None:
    state = {"a": torch.randn(5), "b": torch.randn(3, 3), "c": torch.ones(2, dtype=torch.int64)}
    staging = HostStaging()
    staging.copy(state)
    state["b"] = torch.randn(4, 3)  # new shape
    state["c"] = torch.ones(2, dtype=torch.int32)  # new dtype
    state["d"] = torch.randn(2)  # a tensor more
    host = staging.copy(state)
    assert (staging.allocated, staging.reused) == (3, 1)
    for key, value in state.items():
        assert host[key].dtype == value.dtype and torch.equal(host[key], value), key


def test_a_refused_state_leaves_the_previous_copy_untouched() -> None:
    staging = HostStaging()
    host = staging.copy({"w": torch.zeros(4)})
    with pytest.raises(CheckpointError, match=r"state\['x'\] is a object"):
        staging.copy({"w": torch.ones(4), "x": object()})
    assert torch.equal(host["w"], torch.zeros(4))


def test_one_writer_thread_serves_every_save_and_stops_at_close(tmp_path: Path) -> None:
    before = len(_writer_threads())
    manager = CheckpointManager(tmp_path, keep=2, fingerprint="fp", is_writer=True)
    for step in range(1, 5):
        manager.save(step, {"w": torch.full((10,), float(step))})
    manager.flush()
    assert len(_writer_threads()) == before + 1
    manager.close()
    assert len(_writer_threads()) == before
    assert manager.latest_step() == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000003", "step-000000004"]


_SAVE_AT_EXIT = textwrap.dedent(
    """
    import atexit, sys
    import torch
    from elastic_train.state.checkpoint import CheckpointManager

    manager = CheckpointManager(sys.argv[1], keep=2, fingerprint="fp", is_writer=True)
    manager.save(1, {"w": torch.ones(3)})
    # atexit runs after the interpreter stopped its thread pools: no writer thread any more.
    atexit.register(lambda: manager.save(2, {"w": torch.full((3,), 2.0)}))
    """
)


@pytest.mark.slow
def test_a_save_after_the_writer_pool_shut_down_is_written_in_the_caller(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _SAVE_AT_EXIT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    reader = CheckpointManager(tmp_path, keep=2, fingerprint="fp", is_writer=False)
    assert reader.latest_step() == 2
    assert torch.equal(reader.load(2, map_location="cpu")["w"], torch.full((3,), 2.0))
