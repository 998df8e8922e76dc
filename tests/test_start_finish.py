"""Start and finish: ``checkpoint.init_from``, ``resume_from`` and ``export_dir``.

Real trainer processes (``python -m elastic_train.main``, one process, gloo)
and real files; the format readers are checked on files written by the
libraries that define them (safetensors, torch.save, a Hugging Face layout).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from workers import run_main

from elastic_train.errors import EXIT_CONFIG_ERROR, ConfigError
from elastic_train.state.weights import check_weights, read_weights, resume_checkpoint

TINY = (
    "--model.name=mlp", "--model.hidden_size=16", "--data.name=synthetic",
    "--data.num_samples=64", "--data.num_features=8", "--data.num_classes=4",
    "--training.global_batch_size=16", "--training.final_loss_samples=64",
    "--logging.format=json", "--checkpoint.interval_steps=4", "--checkpoint.keep=5",
    "--schedule.name=constant", "--schedule.warmup_steps=0",
)  # fmt: skip
ATOL = 2e-6


def _trainer(*args: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """``python -m elastic_train.main``, forked (tests/workers.py); its structured log."""
    proc = run_main([*TINY, *args], timeout=180)
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    return proc, events


def _event(events: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [e for e in events if e["event"] == name]
    return found


def _params(audit_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(audit_dir / "final_params.pt", weights_only=True)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=ATOL) for k in a)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 steps with checkpoints at 4, 8, 12 and an export at the end."""
    root = tmp_path_factory.mktemp("trained")
    proc, _ = _trainer(
        "--training.steps=12", f"--checkpoint.dir={root / 'ckpt'}",
        f"--checkpoint.export_dir={root / 'export'}", f"--logging.audit_dir={root / 'audit'}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.slow
def test_export_writes_the_final_weights_in_both_formats(trained: Path) -> None:
    final = _params(trained / "audit")
    export = trained / "export"
    assert sorted(p.name for p in export.iterdir()) == ["model.pt", "model.safetensors"]
    assert _close(load_file(export / "model.safetensors"), final)
    assert _close(torch.load(export / "model.pt", weights_only=True), final)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["export/model.safetensors", "export/model.pt", "ckpt"])
def test_init_from_loads_weights_only(trained: Path, tmp_path: Path, source: str) -> None:
    # A learning rate of 1e-12 leaves the loaded weights where they are, so the
    # final parameters show what the run started from.
    proc, events = _trainer(
        "--training.steps=2", "--optimizer.lr=1e-12", f"--checkpoint.dir={tmp_path / 'ckpt'}",
        f"--checkpoint.init_from={trained / source}", f"--logging.audit_dir={tmp_path}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _event(events, "init_from_loaded")["tensors"] == 6
    # Weights only: the step and the schedule start from zero, not from step 12.
    assert _event(events, "resumed")["restored_step"] == 0
    assert json.loads((tmp_path / "result.json").read_text())["final_step"] == 2
    assert _close(_params(tmp_path), _params(trained / "audit"))


@pytest.mark.slow
def test_init_from_another_model_is_refused_before_training(trained: Path, tmp_path: Path) -> None:
    proc, events = _trainer(
        "--training.steps=2", "--model.hidden_size=32", f"--checkpoint.dir={tmp_path}",
        f"--checkpoint.init_from={trained / 'export' / 'model.safetensors'}",
    )  # fmt: skip
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-3000:]
    error = _event(events, "config_error")["error"]
    assert "checkpoint.init_from" in error and "the weights of another model" in error
    assert "shape mismatch (5): 0.weight: checkpoint [16, 8], model [32, 8]" in error, error
    # Refused before this worker joined any process group.
    assert not {"process_group_ready", "resumed", "step"} & {e["event"] for e in events}
    assert not list(tmp_path.glob("step-*"))


def test_weight_readers_and_the_mismatch_message(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    weights = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    # A sharded Hugging Face directory, keys carrying DDP's "module." prefix.
    hf = tmp_path / "hf"
    hf.mkdir()
    names = sorted(weights)
    save_file({f"module.{k}": weights[k] for k in names[:2]}, hf / "a.safetensors")
    save_file({f"module.{k}": weights[k] for k in names[2:]}, hf / "b.safetensors")
    index = {"weight_map": {f"module.{k}": ("a" if k in names[:2] else "b") + ".safetensors"
                            for k in names}}  # fmt: skip
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _close(read_weights(str(hf)), weights)
    # A Hugging Face directory with pytorch_model.bin.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save(weights, bin_dir / "pytorch_model.bin")
    loaded = read_weights(str(bin_dir))
    assert _close(loaded, weights)
    check_weights(model, loaded, source="x")  # the same model: accepted

    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1), torch.nn.ReLU())
    with pytest.raises(ConfigError) as info:
        check_weights(other, loaded, source="x")
    assert str(info.value).startswith("checkpoint.init_from = 'x': the weights of another model")
    assert "0.weight: checkpoint [2, 3], model [4, 3]" in str(info.value)
    del loaded["1.bias"]
    loaded["head.weight"] = torch.zeros(1)
    with pytest.raises(ConfigError, match=r"missing in the checkpoint \(1\): 1\.bias; "
                                          r"not in the model \(1\): head\.weight"):  # fmt: skip
        check_weights(model, loaded, source="x")
    for bad, expected in ((tmp_path / "nothing", "no such file"), (tmp_path, "without weights")):
        with pytest.raises(ConfigError, match=expected):
            read_weights(str(bad))


def test_resume_from_must_name_a_complete_step(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.resume_from = .*no such checkpoint"):
        resume_checkpoint(str(tmp_path / "step-000000004"))
    (tmp_path / "step-000000004").mkdir()
    with pytest.raises(ConfigError, match=r"no MANIFEST\.json \(its completion marker\)"):
        resume_checkpoint(str(tmp_path / "step-000000004"))
    with pytest.raises(ConfigError, match="name one step directory"):
        resume_checkpoint(str(tmp_path))


@pytest.mark.slow
def test_resume_from_seeds_a_run_and_a_restart_does_not_jump_back(
    trained: Path, tmp_path: Path
) -> None:
    chosen = trained / "ckpt" / "step-000000008"
    common = (f"--checkpoint.dir={tmp_path / 'ckpt'}", f"--checkpoint.resume_from={chosen}",
              f"--logging.audit_dir={tmp_path / 'audit'}")  # fmt: skip
    proc, events = _trainer("--training.steps=12", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = _event(events, "resumed")
    assert (resumed["restored_step"], resumed["source"]) == (8, "resume_from")
    # The full state came back: steps 9-12 replay the original run exactly.
    assert _close(_params(tmp_path / "audit"), _params(trained / "audit"))

    # A restart of this run, now at step 12, keeps its own state.
    proc, events = _trainer("--training.steps=14", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _event(events, "resume_from_ignored")["restored_step"] == 12
    assert _event(events, "resumed")["restored_step"] == 12

    # A checkpoint of another model: its full state cannot be resumed.
    proc, events = _trainer(
        "--training.steps=12", "--model.hidden_size=32", f"--checkpoint.dir={tmp_path / 'b'}",
        f"--checkpoint.resume_from={chosen}",
    )  # fmt: skip
    assert proc.returncode == EXIT_CONFIG_ERROR
    assert "config fingerprint" in _event(events, "config_error")["error"]
    assert "training_started" not in {e["event"] for e in events}

    # An incomplete step directory (no completion marker) is refused, naming the key.
    incomplete = tmp_path / "other" / "step-000000004"
    incomplete.mkdir(parents=True)
    proc, events = _trainer(
        "--training.steps=4", f"--checkpoint.dir={tmp_path / 'fresh'}",
        f"--checkpoint.resume_from={incomplete}",
    )  # fmt: skip
    assert proc.returncode == EXIT_CONFIG_ERROR
    assert "checkpoint.resume_from" in _event(events, "config_error")["error"]
    assert "training_started" not in {e["event"] for e in events}
