"""``elastic-train local --checkpoint.writer=agent`` through a kill and a join, and a
whole-job resume from a checkpoint that a node agent wrote.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from chaos_runs import PACED_STEPS, assert_completed_exactly_once
from steered_runs import STEERED_MLP, Pace, assert_ends_like, run_steered_kill_then_join
from workers import run_main

from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.state.checkpoint_files import MANIFEST

AGENT_WRITER = "--checkpoint.writer=agent"


def persisted_steps(run_dir: Path) -> set[int]:
    """The steps the node agents' persisters wrote (their ``checkpoint_persisted`` lines)."""
    found = set()
    for path in (run_dir / "logs").glob("node*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if '"checkpoint_persisted"' in line:
                found.add(json.loads(line)["step"])
    return found


@pytest.mark.slow
def test_agent_writer_kill_join_and_resume_from_its_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "chaos"
    # 0.1 s a forward until the rejoined world trains, then none.
    pace = Pace(tmp_path / "pause", 0.1)
    summary = run_steered_kill_then_join(run_dir, *STEERED_MLP, AGENT_WRITER, pace=pace)
    assert_completed_exactly_once(summary, steps=PACED_STEPS)
    # The reference: one process, no faults, no pause file (unpaced).
    assert_ends_like(summary, run_dir, tmp_path / "reference", STEERED_MLP)
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    assert '"checkpoint_persist_failed"' not in logs
    assert '"checkpoint_writer_fallback"' not in logs

    # The agents wrote checkpoints in the trainer's format (the paced steps leave them time).
    checkpoints = run_dir / "checkpoints"
    on_disk = {
        int(m.group(1)) for p in checkpoints.iterdir() if (m := re.match(r"step-(\d+)$", p.name))
    }
    by_agent = sorted((persisted_steps(run_dir) & on_disk) - {PACED_STEPS})
    assert by_agent, (persisted_steps(run_dir), on_disk)
    resume_step = by_agent[-1]
    fingerprint = json.loads((checkpoints / f"step-{resume_step:09d}" / MANIFEST).read_text())
    manager = CheckpointManager(checkpoints, keep=3, is_writer=False,
                                fingerprint=fingerprint["body"]["fingerprint"])  # fmt: skip
    assert manager.load(resume_step, map_location="cpu")["step"] == resume_step

    # A whole-job restart from it: one process, the agent's checkpoint alone on disk.
    resumed = tmp_path / "resumed"
    (resumed / "ckpt").mkdir(parents=True)
    name = f"step-{resume_step:09d}"
    shutil.copytree(checkpoints / name, resumed / "ckpt" / name)
    # The model's options as the run's (they are part of the config fingerprint); the
    # pause file now says 0.
    resume = [*STEERED_MLP, f"--model.options.pause_file={pace.path}"]
    proc = run_main(  # python -m elastic_train.main, forked (tests/workers.py)
        [*resume, f"--logging.audit_dir={resumed / 'audit'}",
         f"--checkpoint.dir={resumed / 'ckpt'}"], timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f'"restored_step": {resume_step}' in proc.stdout + proc.stderr
    expected = torch.load(run_dir / "audit" / "final_params.pt", weights_only=True)
    actual = torch.load(resumed / "audit" / "final_params.pt", weights_only=True)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-5)
