"""``training.compile = true``: torch.compile (inductor, CPU) under DDP, through a real
kill and restart, ends with the parameters of an uncompiled, fault-free run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from steered_runs import forked_reference

STEPS = 24
TRAINER_ARGS = [
    "--data.name=synthetic", "--data.num_samples=1024", "--training.global_batch_size=16",
    f"--training.steps={STEPS}", "--training.final_loss_samples=96",
    "--checkpoint.interval_steps=4",
]  # fmt: skip
PACED = "--model.name=tests.paced_model:paced_mlp"


@pytest.mark.slow
def test_compiled_run_survives_a_kill_and_matches_an_uncompiled_one(tmp_path: Path) -> None:
    # A cache of its own: the compilation happens here, and the files show it did.
    cache = tmp_path / "inductor"
    # One compile thread: a pool of compile workers (each importing torch) per node
    # costs more than it saves for a model this small on a 2-core box.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # fmt: skip
    run_dir, summary_path = tmp_path / "run", tmp_path / "summary.json"
    command = [
        sys.executable, "-m", "elastic_train.cli", "local", "--nodes", "2", "--min-nodes", "1",
        "--chaos", "kill:1@step8", "--json", str(summary_path), "--run-dir", str(run_dir),
        "--quiet", "--no-timeline", "--timeout", "400", "--metrics-port", "0", *TRAINER_ARGS,
        "--training.compile=true", PACED, "--model.options.seconds=0.1",
    ]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=480)
    assert summary_path.is_file(), proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["completed"] and summary["final_step"] == STEPS, summary
    assert [r["kind"] for r in summary["recoveries"]] == ["kill"], summary["recoveries"]
    assert summary["exactly_once"], summary["exactly_once_detail"]
    assert any(cache.rglob("*.py")), "inductor wrote no generated code: nothing was compiled"
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("node*.log"))
    assert logs.count('"compile_enabled"') >= 2  # the first start and the restart

    # One process, uncompiled, unpaced, without faults.
    expected, _ = forked_reference(
        tmp_path / "ref", [*TRAINER_ARGS, PACED, "--model.options.seconds=0"]
    )
    actual = torch.load(run_dir / "audit" / "final_params.pt", weights_only=True)
    assert expected.keys() == actual.keys()  # no "_orig_mod." prefix in checkpoints
    for name in expected:
        # Inductor's fused kernels and the resize change the summation order only.
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-5)
