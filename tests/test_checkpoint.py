"""CheckpointManager with real files, real torch.save/torch.load and real crashes."""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs
from workers import run_code

from elastic_train.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
)
from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.state.checkpoint_files import MANIFEST, STATE_FILE
from elastic_train.training.rng import capture_rng_state, restore_rng_state
from elastic_train.training.sampler import ElasticSampler

FP = "fingerprint-a"


def _manager(directory: Path, **kwargs: object) -> CheckpointManager:
    options: dict = {"keep": 3, "fingerprint": FP, "is_writer": True, **kwargs}
    return CheckpointManager(directory, **options)


def _state(value: float, numel: int = 16) -> dict:
    return {"model": {"w": torch.full((numel,), value)}, "step": int(value)}


def _fallbacks(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "checkpoint_fallback"]


def _training_state() -> tuple[dict, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    sampler = ElasticSampler(10, global_batch_size=4, seed=5)
    sampler.next_global_batch()
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "sampler": sampler.state_dict(),
        "rng": capture_rng_state(),
        "step": 1,
    }
    return state, model


def test_round_trip_restores_every_part_and_records_metadata(tmp_path: Path) -> None:
    state, model = _training_state()
    with _manager(tmp_path) as manager:
        manager.save(1, state, blocking=True)
    draws = (torch.rand(3), random.random(), np.random.rand())

    reader = _manager(tmp_path, is_writer=False)
    step, loaded = reader.load_latest(map_location="cpu")
    assert step == 1
    for key, value in model.state_dict().items():
        assert torch.equal(loaded["model"][key], value)
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert torch.equal(
        loaded["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"]
    )
    assert loaded["scheduler"] == state["scheduler"]
    assert loaded["sampler"] == {"seed": 5, "epoch": 0, "samples_consumed": 4}
    restore_rng_state(loaded["rng"])
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]
    meta = reader.loaded_metadata
    assert meta is not None and meta["step"] == 1 and meta["world_size"] == 1
    assert set(meta["versions"]) == {"torch", "python", "elastic_train"}
    assert meta["wall_time"] > 0


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "target"),
    [
        (_truncate, STATE_FILE),
        (_flip_bit, STATE_FILE),
        (_flip_bit, MANIFEST),
        (Path.unlink, MANIFEST),
    ],
    ids=["truncated-state", "bitflip-state", "bitflip-manifest", "no-manifest"],
)
def test_damaged_latest_falls_back_to_previous_good(tmp_path: Path, damage, target: str) -> None:
    manager = _manager(tmp_path, async_save=False)
    manager.save(1, _state(1.0))
    manager.save(2, _state(2.0))
    damage(tmp_path / "step-000000002" / target)
    with capture_logs() as logs:
        step, state = manager.load_latest(map_location="cpu")
    assert step == 1 and torch.equal(state["model"]["w"], torch.full((16,), 1.0))
    assert [e["step"] for e in _fallbacks(logs)] == [2]
    assert all(e["log_level"] == "warning" for e in _fallbacks(logs))


def test_fingerprint_mismatch_is_refused_naming_both(tmp_path: Path) -> None:
    _manager(tmp_path, async_save=False).save(1, _state(1.0))
    other = CheckpointManager(tmp_path, keep=3, fingerprint="fingerprint-b", is_writer=False)
    with pytest.raises(CheckpointMismatchError, match=r"'fingerprint-a'.*'fingerprint-b'"):
        other.load_latest(map_location="cpu")


class _Booby:
    """Unpickling this creates the marker file: proof that something was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _forge_manifest(directory: Path, step: int) -> None:
    """A manifest that is valid in every respect except that it describes a foreign file."""
    from elastic_train.state.checkpoint_files import FORMAT, manifest_checksum

    data = (directory / STATE_FILE).read_bytes()
    files = {STATE_FILE: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}
    meta = {"step": step, "world_size": 1, "wall_time": 0.0, "versions": {}}
    body = {"format": FORMAT, "step": step, "fingerprint": FP, "files": files, "metadata": meta}
    document = {"body": body, "sha256": manifest_checksum(body)}
    (directory / MANIFEST).write_text(json.dumps(document))


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
@pytest.mark.parametrize("with_manifest", [False, True])
def test_foreign_pickle_is_refused_without_unpickling(
    tmp_path: Path, writer: str, with_manifest: bool
) -> None:
    manager = _manager(tmp_path / "ckpt", async_save=False)
    manager.save(1, _state(1.0))
    marker = tmp_path / "unpickled-marker"
    evil = tmp_path / "ckpt" / "step-000000009"
    evil.mkdir()
    with open(evil / STATE_FILE, "wb") as file:
        if writer == "pickle":
            pickle.dump({"model": _Booby(marker)}, file, protocol=2)
        else:
            torch.save({"model": _Booby(marker)}, file)
    if with_manifest:
        _forge_manifest(evil, 9)
    with capture_logs() as logs:
        step, _ = manager.load_latest(map_location="cpu")
    assert not marker.exists()
    assert step == 1
    assert [e["step"] for e in _fallbacks(logs)] == [9]


def test_async_save_blocks_only_for_the_host_copy(tmp_path: Path) -> None:
    state = {"w": torch.randn(8_000_000), "step": 1}  # 32 MB
    manager = _manager(tmp_path)
    manager.save(1, state)
    stats = manager.last_save_stats
    assert stats is not None
    # The loop keeps training: the checkpoint must hold the values at save time.
    expected = state["w"].clone()
    state["w"].add_(1.0)
    manager.flush()
    assert stats.write_seconds is not None and stats.bytes > 32_000_000
    overhead = stats.blocked_seconds - stats.wait_seconds - stats.copy_seconds
    assert stats.blocked_seconds < stats.write_seconds
    assert overhead < 0.25 * stats.write_seconds
    _, loaded = manager.load_latest(map_location="cpu")
    assert torch.equal(loaded["w"], expected)
    # A blocking save of the same state does hold the caller for the whole write.
    manager.save(2, state, blocking=True)
    blocking = manager.last_save_stats
    assert blocking is not None and blocking.write_seconds is not None
    assert blocking.blocked_seconds >= blocking.copy_seconds + blocking.write_seconds


def test_a_new_save_waits_for_the_one_in_flight(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    manager.save(1, {"w": torch.randn(4_000_000)})
    manager.save(2, {"w": torch.randn(4_000_000)})
    # save(2) returned, so save(1) was complete before save(2) copied anything.
    assert (tmp_path / "step-000000001" / MANIFEST).exists()
    manager.close()
    assert manager.latest_step() == 2


def test_keeps_the_last_n_and_never_newer_ones(tmp_path: Path) -> None:
    manager = _manager(tmp_path, keep=2, async_save=False)
    (tmp_path / "step-000000002").mkdir()  # a partial leftover from a crash
    for step in (1, 3, 4, 5):
        manager.save(step, _state(float(step)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000004", "step-000000005"]
    # After a fallback to step 4, saving step 4 again keeps the newer step 5 on disk.
    manager.save(4, _state(40.0))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-000000004", "step-000000005"]
    assert manager.load(4, map_location="cpu")["model"]["w"][0] == 40.0


def test_only_the_writer_writes(tmp_path: Path) -> None:
    reader = _manager(tmp_path / "ckpt", is_writer=False)
    reader.save(1, _state(1.0), blocking=True)
    assert not (tmp_path / "ckpt").exists()
    assert reader.load_latest(map_location="cpu") is None and reader.latest_step() is None


def test_state_that_weights_only_would_refuse_is_rejected_at_save(tmp_path: Path) -> None:
    manager = _manager(tmp_path, async_save=False)
    with pytest.raises(CheckpointError, match=r"state\['model'\]\['w'\] is a object"):
        manager.save(1, {"model": {"w": object()}})
    assert manager.latest_step() is None


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.keep"):
        _manager(tmp_path, keep=0)


# ------------------------------------------------- crashes and full disks in a subprocess

_CHILD = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    import torch
    from elastic_train.state.checkpoint import CheckpointManager
    from elastic_train.errors import CheckpointWriteError
    from elastic_train.log import configure_logging

    configure_logging(json=True)  # events to stderr, the result to stdout
    directory, mode = sys.argv[1:3]
    # keep=1: were step 1 pruned before step 2 completed, nothing would be left
    manager = CheckpointManager(directory, keep=1, fingerprint="fingerprint-a", is_writer=True)
    big = {"model": {"w": torch.ones(4_000_000)}, "step": 2}  # 16 MB
    if mode == "exit-while-writing":
        manager.save(2, big)  # asynchronous, and the interpreter exits right away
        sys.exit(0)
    if mode == "before-manifest":
        CheckpointManager._write_manifest = lambda *a, **k: os._exit(3)
        manager.save(2, big, blocking=True)
    # Python ignores SIGXFSZ, so writes past the limit fail with EFBIG ("disk full");
    # restoring the default makes the kernel kill the process mid-write instead.
    if mode == "mid-write":
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    try:
        manager.save(2, big, blocking=True)
    except CheckpointWriteError as exc:
        message = str(exc)
    manager.save(3, big)  # an asynchronous failure is counted too
    manager.flush()
    try:
        manager.raise_if_failing(2)
    except CheckpointWriteError as exc:
        print(json.dumps({"message": message, "limit": str(exc),
                          "failures": manager.consecutive_failures}))
    """
)


def _run_child(directory: Path, mode: str) -> subprocess.CompletedProcess:
    if mode == "exit-while-writing":  # the interpreter's own exit: a new one
        return subprocess.run(
            [sys.executable, "-c", _CHILD, str(directory), mode],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    return run_code(_CHILD, [str(directory), mode])  # forked: torch is imported


def _assert_only_step_1_is_complete(directory: Path) -> None:
    manager = _manager(directory, is_writer=False)
    assert manager.latest_step() == 1
    step, state = manager.load_latest(map_location="cpu")
    assert step == 1 and state["model"]["w"][0] == 1.0
    complete = [p.name for p in directory.iterdir() if (p / MANIFEST).exists()]
    assert complete == ["step-000000001"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mid-write", "before-manifest"])
def test_crash_during_a_write_leaves_nothing_that_looks_complete(tmp_path: Path, mode: str) -> None:
    _manager(tmp_path, async_save=False).save(1, _state(1.0))
    result = _run_child(tmp_path, mode)
    # mid-write: the kernel kills the child with SIGXFSZ halfway through state.pt
    assert result.returncode == (-signal.SIGXFSZ if mode == "mid-write" else 3), result.stderr
    _assert_only_step_1_is_complete(tmp_path)
    # The next writer cleans up after the crash and saves normally.
    manager = _manager(tmp_path, async_save=False)
    manager.save(2, _state(2.0))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert manager.load_latest(map_location="cpu")[0] == 2


@pytest.mark.slow
def test_disk_full_is_counted_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    _manager(tmp_path, async_save=False).save(1, _state(1.0))
    result = _run_child(tmp_path, "disk-full")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert "saving checkpoint step 2" in report["message"]
    assert "File too large" in report["message"]
    assert report["failures"] == 2
    assert "2 checkpoint saves in a row failed" in report["limit"]
    assert "checkpoint_write_failed" in result.stderr
    _assert_only_step_1_is_complete(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


@pytest.mark.slow
def test_an_in_flight_save_is_flushed_at_interpreter_exit(tmp_path: Path) -> None:
    _manager(tmp_path, async_save=False).save(1, _state(1.0))
    result = _run_child(tmp_path, "exit-while-writing")
    assert result.returncode == 0, result.stderr
    step, state = _manager(tmp_path, is_writer=False).load_latest(map_location="cpu")
    assert step == 2 and state["model"]["w"].shape == (4_000_000,)


def test_format_1_checkpoints_with_sha256_still_load(tmp_path: Path) -> None:
    from elastic_train.state.checkpoint_files import manifest_checksum

    manager = _manager(tmp_path, async_save=False)
    manager.save(1, _state(1.0))
    directory = tmp_path / "step-000000001"
    body = json.loads((directory / MANIFEST).read_text())["body"]
    assert set(body["files"][STATE_FILE]) == {"crc32", "bytes"}
    data = (directory / STATE_FILE).read_bytes()
    body["format"] = "elastic_train.checkpoint/1"
    body["files"] = {STATE_FILE: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}
    document = {"body": body, "sha256": manifest_checksum(body)}
    (directory / MANIFEST).write_text(json.dumps(document))
    assert torch.equal(manager.load(1, map_location="cpu")["model"]["w"], torch.full((16,), 1.0))
    _flip_bit(directory / STATE_FILE)
    with pytest.raises(CheckpointCorruptError, match="sha256 does not match"):
        manager.load(1, map_location="cpu")
