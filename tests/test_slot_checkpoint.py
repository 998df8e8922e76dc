"""Checkpoints whose state is a snapshot slot's bytes (``state.slot``, format 3),
as the node agent's writer leaves them: real files, read back with nothing unpickled."""

from __future__ import annotations

import json
import subprocess
import tracemalloc
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from elastic_train.cli import EXIT_USAGE, main
from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.state.checkpoint_files import MANIFEST, SLOT_FILE, SLOT_FORMAT, STATE_FILE
from elastic_train.state.snapshot_layout import ALGORITHM, HEADER_BYTES, pack, verify
from elastic_train.state.weights import read_weights

FP = "fingerprint-slot"


def _state(value: float) -> dict:
    torch.manual_seed(int(value))
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": {"seed": 5, "epoch": 1, "samples_consumed": int(value) * 8},
        "rng": {"torch": torch.get_rng_state()},
        "step": int(value),
    }


def _write_slot(manager: CheckpointManager, step: int, state: dict, *, fingerprint: str = FP):
    raw = pack(state, step=step, fingerprint=fingerprint)
    header, _ = verify(raw, fingerprint=fingerprint, name="test")
    manager.write_slot(
        step, raw, digest=header[ALGORITHM], metadata={**manager._metadata(step), "x": 1}
    )


def _assert_same(loaded: dict, state: dict) -> None:
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value)
    assert torch.equal(
        loaded["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"]
    )
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert loaded["sampler"] == state["sampler"] and loaded["step"] == state["step"]
    assert torch.equal(loaded["rng"]["torch"], state["rng"]["torch"])


def test_a_slot_checkpoint_loads_beside_torch_save_ones_and_rotates(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2, fingerprint=FP, async_save=False, is_writer=True)
    manager.save(1, _state(1.0))  # the trainer writer's state.pt
    states = {step: _state(float(step)) for step in (2, 3)}
    for step, state in states.items():
        _write_slot(manager, step, state)
    directory = tmp_path / "step-000000003"
    assert {p.name for p in directory.iterdir()} == {SLOT_FILE, MANIFEST}
    body = json.loads((directory / MANIFEST).read_text())["body"]
    assert body["format"] == SLOT_FORMAT
    assert body["metadata"]["step"] == 3 and body["metadata"]["x"] == 1
    assert not (tmp_path / "step-000000001").exists()  # keep = 2 counts both kinds
    assert manager.loadable_steps(limit=5) == [3, 2]
    step, loaded = manager.load_latest(map_location="cpu")
    assert step == 3
    _assert_same(loaded, states[3])
    _assert_same(manager.load(2, map_location="cpu"), states[2])
    manager.save(4, _state(4.0))  # and back to state.pt in the same directory
    assert manager.loadable_steps(limit=5) == [4, 3]
    assert (tmp_path / "step-000000004" / STATE_FILE).exists()
    # checkpoint.init_from reads a slot checkpoint like any other of ours.
    weights = read_weights(str(directory))
    assert torch.equal(weights["weight"], states[3]["model"]["weight"])


def test_a_slot_checkpoint_is_mapped_not_read_into_memory(tmp_path: Path) -> None:
    """A 32 MiB slot restores with no copy of the file in Python's memory: the
    decoded tensors come straight from the mapped pages (a read into a
    bytearray first, as before, made the restore's peak twice the state)."""
    manager = CheckpointManager(tmp_path, keep=1, fingerprint=FP, async_save=False, is_writer=True)
    state = {"model": {"w": torch.randn(8 << 20)}, "step": 7}  # 32 MiB of float32
    _write_slot(manager, 7, state)
    size = (tmp_path / "step-000000007" / SLOT_FILE).stat().st_size
    tracemalloc.start()
    try:
        loaded = manager.load(7, map_location="cpu")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["step"] == 7
    assert peak < size // 8, f"{peak} bytes allocated by Python loading a {size}-byte slot"


def _flip(offset_of: object) -> object:
    def damage(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[offset_of(len(data))] ^= 0x10
        path.write_bytes(bytes(data))

    return damage


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 64])


def _swap_in_another_step(path: Path) -> None:
    # A whole, valid slot, but not the one the manifest names.
    path.write_bytes(bytes(pack(_state(9.0), step=2, fingerprint=FP)))


def _another_config(path: Path) -> None:
    path.write_bytes(bytes(pack(_state(2.0), step=2, fingerprint="another-config")))


@pytest.mark.parametrize(
    "damage",
    [
        _flip(lambda n: HEADER_BYTES + 40),
        _flip(lambda n: 100),
        _truncate,
        _swap_in_another_step,
        _another_config,
    ],
    ids=["bitflip-data", "bitflip-header", "truncated", "another-slot", "another-fingerprint"],
)
def test_a_damaged_slot_checkpoint_falls_back_to_the_previous_good(tmp_path: Path, damage) -> None:
    manager = CheckpointManager(tmp_path, keep=3, fingerprint=FP, async_save=False, is_writer=True)
    first = _state(1.0)
    _write_slot(manager, 1, first)
    _write_slot(manager, 2, _state(2.0))
    damage(tmp_path / "step-000000002" / SLOT_FILE)
    with capture_logs() as logs:
        step, loaded = manager.load_latest(map_location="cpu")
    assert step == 1
    _assert_same(loaded, first)
    fallbacks = [e for e in logs if e["event"] == "checkpoint_fallback"]
    assert [e["step"] for e in fallbacks] == [2]
    assert SLOT_FILE in fallbacks[0]["reason"]


# -- elastic-train export: a checkpoint's weights for torch.load -----------------------


def _export(
    source: Path, out: Path, capsys: pytest.CaptureFixture[str]
) -> subprocess.CompletedProcess[str]:
    """``elastic-train export SOURCE OUT``, through the CLI's ``main`` in this process
    (the entry point itself runs in every ``elastic-train local`` test)."""
    argv = ["export", str(source), str(out)]
    code = main(argv)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, captured.out, captured.err)


def _assert_exported(out: Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    for loaded in (
        torch.load(out / "model.pt", weights_only=True),
        load_file(out / "model.safetensors"),
    ):
        assert loaded.keys() == weights.keys()
        assert all(torch.equal(loaded[name], tensor) for name, tensor in weights.items())


def test_export_writes_either_kind_of_checkpoint_as_plain_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script that torch.loads the weights gets them from a state.slot too."""
    directory = tmp_path / "ckpt"
    manager = CheckpointManager(directory, keep=3, fingerprint=FP, async_save=False, is_writer=True)
    manager.save(1, _state(1.0))  # the trainer writer's state.pt
    _write_slot(manager, 2, _state(2.0))  # the node agent's state.slot: the newest
    done = _export(directory, tmp_path / "newest", capsys)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert Path(summary["source"]) == directory / "step-000000002"
    assert summary["tensors"] == 2 and summary["elements"] == 4 * 3 + 3
    _assert_exported(tmp_path / "newest", _state(2.0)["model"])
    done = _export(directory / "step-000000001", tmp_path / "first", capsys)
    assert done.returncode == 0, done.stderr
    _assert_exported(tmp_path / "first", _state(1.0)["model"])


def test_export_refuses_a_damaged_or_missing_source_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manager = CheckpointManager(tmp_path, keep=3, fingerprint=FP, async_save=False, is_writer=True)
    _write_slot(manager, 1, _state(1.0))
    _flip(lambda n: HEADER_BYTES + 40)(tmp_path / "step-000000001" / SLOT_FILE)
    for source, expected in (
        (tmp_path, "unusable checkpoint: "),
        (tmp_path / "nowhere", "no such file or directory"),
    ):
        done = _export(source, tmp_path / "out", capsys)
        assert done.returncode == EXIT_USAGE, done.stderr
        # The checkpoint directory's error names the step it tried.
        assert f"elastic-train export: error: SOURCE = '{source}" in done.stderr
        assert expected in done.stderr, done.stderr
        assert not (tmp_path / "out").exists()
