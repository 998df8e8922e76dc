"""Bad input fails at start with a clear message; bad checkpoints are refused.

Real trainer processes (``python -m elastic_train.main``), one process each.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from workers import run_main

from elastic_train.config.job import fingerprint
from elastic_train.config.load import load_config
from elastic_train.errors import EXIT_CHECKPOINT_FAILURES, EXIT_CONFIG_ERROR
from elastic_train.main import main
from elastic_train.state import checkpoint as ckpt
from elastic_train.state.checkpoint_files import STATE_FILE, manifest_checksum

REPO = Path(__file__).resolve().parents[1]
TINY = (
    "--model.name=mlp", "--model.hidden_size=16", "--data.name=synthetic",
    "--data.num_samples=64", "--data.num_features=8", "--data.num_classes=4",
    "--training.global_batch_size=16", "--training.final_loss_samples=64",
    "--logging.format=json", "--checkpoint.interval_steps=2",
)  # fmt: skip


def _trainer(*args: str, launch: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python -m elastic_train.main ARGS`` (forked, tests/workers.py), or ``python
    LAUNCH ARGS`` in a new interpreter."""
    path = [str(REPO / "examples"), str(REPO / "tests")]
    if not launch:
        return run_main(args, sys_path=path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run(
        [sys.executable, *launch, *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('[training]\nsteps = "ten"\n', "training.steps = 'ten': expected an integer"),
        ("[training]\nstepz = 10\n", "unknown key training.stepz; known keys: steps"),
        ("[trianing]\nsteps = 10\n", "unknown section [trianing]"),
        ('[training]\nprecision = "fp8"\n', "one of 'fp32', 'bf16', 'fp16'"),
    ],
)
def test_bad_config_file_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str, expected: str
) -> None:
    path = tmp_path / "job.toml"
    path.write_text(toml)
    assert main(["--config", str(path)]) == EXIT_CONFIG_ERROR
    assert expected in capsys.readouterr().err


@pytest.mark.slow
def test_missing_dataset_is_refused_at_start(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csv"
    proc = _trainer(
        *TINY, "--data.name=custom_model_dataset:make_dataset", "--model.name=mlp",
        f"--data.options.path={missing}", "--checkpoint.dir=",
    )  # fmt: skip
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr
    assert f"data.options.path = {str(missing)!r}: no such file" in proc.stderr
    proc = _trainer(*TINY, "--data.name=no_such_package.data:make", "--checkpoint.dir=")
    assert proc.returncode == EXIT_CONFIG_ERROR
    assert "data.name" in proc.stderr and "no_such_package" in proc.stderr


def batch_mean_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The common mistake: a mean over the batch where one loss per sample is due."""
    return F.cross_entropy(output, target)


def sum_only(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, target = batch
    return F.cross_entropy(model(inputs), target, reduction="sum")


def text_count(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[object, str]:
    return sum_only(model, batch), "4"


TOKENS = ("--data.name=test_workload_tokens:token_data", "--model.name=char_transformer",
          "--model.hidden_size=16", "--model.num_heads=2", "--data.num_samples=20")  # fmt: skip
CONTRACT = {
    "per_sample": "model.loss_form = 'per_sample' expects loss(output, target) -> Tensor",
    "sum_count": "model.loss_form = 'sum_count' expects loss(model, batch) -> (loss_sum, count)",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--model.loss=test_bad_input:batch_mean_loss",),
         ["model.loss = 'test_bad_input:batch_mean_loss' (model.loss_form = 'per_sample'): it "
          "returned a torch.float32 tensor of shape () for a micro-batch of 4 samples",
          CONTRACT["per_sample"]]),
        (("--model.loss=test_bad_input:sum_only", "--model.loss_form=sum_count"),
         ["it returned a torch.float32 tensor of shape (), not a pair (loss_sum, count)",
          CONTRACT["sum_count"]]),
        (("--model.loss=test_bad_input:text_count", "--model.loss_form=sum_count"),
         ["its count is a str, not a number", CONTRACT["sum_count"]]),
        ((*TOKENS,),
         ["data.collate_fn = '' (torch's default_collate): cannot make a batch of the items at "
          "indices [0, 1, 2, 3] (the first item is a dict with keys ['input_ids', 'labels']): "
          "RuntimeError: stack expects each tensor to be equal size",
          "data.collate_fn takes", "package.module:function of collate(items: list) -> batch"]),
        ((*TOKENS, "--data.collate_fn=test_workload_tokens:pad_tokens"),
         ["the batch is a dict with keys ['input_ids', 'labels'], not a pair (inputs, target)",
          "model.loss_form = 'sum_count'"]),
        (("--optimizer.name=test_workload_factories:raises",),
         ["optimizer.name = 'test_workload_factories:raises': the factory raised RuntimeError",
          "optimizer.name takes adamw, sgd or an import string"]),
        (("--schedule.name=test_workload_factories:plateau",),
         ["schedule.name = 'test_workload_factories:plateau': the factory returned a "
          "ReduceLROnPlateau", "schedule.name takes constant, cosine, linear"]),
    ],
)  # fmt: skip
def test_bad_loss_collate_or_factory_is_refused_before_training(
    args: tuple[str, ...], expected: list[str]
) -> None:
    proc = _trainer(*TINY, *args, "--checkpoint.dir=", "--training.steps=2")
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-3000:]
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    (error,) = [e["error"] for e in events if e["event"] == "config_error"]
    for text in expected:
        assert text in error, error
    # Refused while building, before the first collective and the first step.
    assert not {"resumed", "training_started", "step"} & {e["event"] for e in events}
    if not any(a.startswith(("--optimizer", "--schedule")) for a in args):
        # Loss and collate are checked before this worker joins a process group;
        # the optimizer and schedule factories need the (possibly sharded) model.
        assert "process_group_ready" not in {e["event"] for e in events}


def _plant(directory: Path, step: int, payload: bytes, *, fingerprint_: str) -> None:
    """A step directory whose manifest vouches for ``payload`` (what an attacker
    with write access to the checkpoint directory could do)."""
    step_dir = directory / f"step-{step:09d}"
    step_dir.mkdir()
    (step_dir / STATE_FILE).write_bytes(payload)
    body = {
        "format": ckpt.FORMAT, "step": step, "fingerprint": fingerprint_,
        "files": {STATE_FILE: {"sha256": hashlib.sha256(payload).hexdigest(),
                                    "bytes": len(payload)}},
        "metadata": {"step": step, "world_size": 1},
    }  # fmt: skip
    manifest = {"body": body, "sha256": manifest_checksum(body)}
    (step_dir / ckpt.MANIFEST).write_text(json.dumps(manifest))


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))  # unpickling would create the marker


@pytest.mark.slow
def test_foreign_and_non_checkpoints_are_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    first = _trainer(*TINY, "--training.steps=4", f"--checkpoint.dir={directory}")
    assert first.returncode == 0, first.stderr

    # Another config (a different model) must not resume from this directory.
    other = _trainer(*TINY, "--training.steps=6", "--model.hidden_size=32",
                     f"--checkpoint.dir={directory}")  # fmt: skip
    assert other.returncode == EXIT_CONFIG_ERROR
    assert "config fingerprint" in other.stderr and "new checkpoint directory" in other.stderr

    # Newer "checkpoints" that are not ours: garbage without a manifest, and a
    # pickle exploit with a manifest that vouches for it. Neither is unpickled.
    marker = tmp_path / "pwned"
    cfg = load_config(None, [arg[2:] for arg in (*TINY, "--training.steps=6")])
    (directory / "step-000000005").mkdir()
    (directory / "step-000000005" / STATE_FILE).write_bytes(b"not a checkpoint")
    _plant(directory, 6, pickle.dumps(_Exploit(marker)), fingerprint_=fingerprint(cfg))
    resumed = _trainer(*TINY, "--training.steps=6", f"--checkpoint.dir={directory}")
    assert resumed.returncode == 0, resumed.stderr
    assert not marker.exists()
    events = [json.loads(line) for line in resumed.stderr.splitlines() if line.startswith("{")]
    fallbacks = [e for e in events if e["event"] == "checkpoint_fallback"]
    assert {e["step"] for e in fallbacks} == {5, 6}
    assert any("refused by torch.load" in e["reason"] for e in fallbacks)
    (resume,) = [e for e in events if e["event"] == "resumed"]
    assert resume["restored_step"] == 4


#: The trainer under a file-size limit small enough for no checkpoint and large
#: enough for progress.json (Python ignores SIGXFSZ: a write past it fails with
#: EFBIG). Set by the child before it execs the trainer, not by a ``preexec_fn``:
#: that runs in a plain fork of this process, where gRPC (the etcd tests' clients)
#: restarts its poller thread, and subprocess then closes the poller's epoll fd:
#: the child aborted before its exec (SIGABRT, "Epoll1Poller encountered
#: epoll_wait error: Bad file descriptor"; grpc/grpc#43055), once in a CI run.
LIMITED_FILE_SIZE = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY)); "
    "os.execv(sys.executable, [sys.executable, '-m', 'elastic_train.main', *sys.argv[1:]])"
)


@pytest.mark.slow
def test_consecutive_checkpoint_failures_end_the_worker(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    proc = _trainer(
        *TINY, "--training.steps=20", f"--checkpoint.dir={directory}",
        "--checkpoint.max_consecutive_failures=3", "--checkpoint.async_save=false",
        launch=("-c", LIMITED_FILE_SIZE),
    )  # fmt: skip
    assert proc.returncode == EXIT_CHECKPOINT_FAILURES, proc.stderr[-2000:]
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    failed = [e for e in events if e["event"] == "checkpoint_write_failed"]
    assert [e["consecutive_failures"] for e in failed] == [1, 2, 3]
    assert all(e["error"] == "File too large" for e in failed)
    (fatal,) = [e for e in events if e["event"] == "checkpoint_failures_exceeded"]
    assert "checkpoint.max_consecutive_failures=3" in fatal["error"]
    assert not list(directory.glob("step-*")) and not list(directory.glob(".tmp-*"))


@pytest.mark.slow
def test_a_config_error_found_while_building_ends_the_agents_instead_of_restarts(
    tmp_path: Path,
) -> None:
    # The runner's own check (parse_cli) passes; only the worker's build finds that
    # the model needs a vocabulary the dataset lacks. Each agent used to restart its
    # worker about once a second until the run's timeout.
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "elastic_train.cli", "local", "--nodes", "2", "--min-nodes", "1",
        "--run-dir", str(run_dir), "--quiet", "--no-timeline", "--timeout", "120",
        "--metrics-port", "0",
        "--model.name=char_transformer", "--data.name=synthetic", "--training.steps=5",
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode != 0
    (said,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "configuration error" in said and "model.name = 'char_transformer'" in said, said
    assert "vocab_size" in said, said
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["nodes"] == {"node0": "exited(78)", "node1": "exited(78)"}, summary
    for node in ("node0", "node1"):
        lines = (run_dir / "logs" / f"{node}.log").read_text().splitlines()
        events = [json.loads(line) for line in lines if line.startswith("{")]
        built = [e for e in events if e.get("event") == "config_error"]
        assert len(built) == 1 and built[0]["restart"] == 0, built  # never restarted
        (ended,) = [e for e in events if e.get("event") == "worker_config_error"]
        assert ended["exit_code"] == EXIT_CONFIG_ERROR and "vocab_size" in ended["error"]
