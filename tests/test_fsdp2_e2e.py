"""End to end with ``training.parallel = "fsdp2"``: real torchrun nodes, a real etcd,
a node killed at world size 3 and joining again at 2.

FSDP2 has no per-step snapshots, so each restart resumes from the newest
DCP checkpoint, saved at one world size and loaded at another (resharding).
The run must still complete exactly once and end where a fault-free fsdp2
run of the same config ends.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from chaos_runs import (
    PACED,
    PACED_MLP,
    PACED_STEPS,
    UNPACED,
    assert_completed_exactly_once,
    assert_ends_like_reference,
    run_kill_then_join,
    worker_records,
)

from elastic_train.local.cluster import MAIN_SCRIPT

STEPS = PACED_STEPS
TRAINER_ARGS = [*PACED_MLP, "--training.parallel=fsdp2"]


@pytest.mark.slow
def test_fsdp2_kill_and_join_end_where_a_fault_free_run_does(tmp_path: Path) -> None:
    run_dir = tmp_path / "chaos"
    summary = run_kill_then_join(run_dir, *TRAINER_ARGS, PACED)
    assert_completed_exactly_once(summary, steps=STEPS)
    # Every restart resumed from a DCP checkpoint written at another world size.
    resumes = worker_records(run_dir, "resume")
    assert {r["source"] for r in resumes if r["restored_step"] > 0} == {"disk"}
    reference = [sys.executable, str(MAIN_SCRIPT), *TRAINER_ARGS, UNPACED]
    assert_ends_like_reference(summary, run_dir, reference, tmp_path=tmp_path)
