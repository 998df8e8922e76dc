"""End to end with ``training.parallel = "fsdp2"``: real torchrun nodes, a real etcd,
a node killed at world size 3 and joining again at 2.

FSDP2 has no per-step snapshots, so each restart resumes from the newest
DCP checkpoint, saved at one world size and loaded at another (resharding).
The run must still complete exactly once and end where a fault-free fsdp2
run of the same config ends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from chaos_runs import PACED_STEPS, assert_completed_exactly_once, worker_records
from steered_runs import STEERED_MLP, Pace, assert_ends_like, run_steered_kill_then_join
from torch_support import needs_fsdp2

STEPS = PACED_STEPS
TRAINER_ARGS = [*STEERED_MLP, "--training.parallel=fsdp2"]


@needs_fsdp2
@pytest.mark.slow
def test_fsdp2_kill_and_join_end_where_a_fault_free_run_does(tmp_path: Path) -> None:
    run_dir = tmp_path / "chaos"
    # 0.1 s a forward until the rejoined world trains, then none.
    pace = Pace(tmp_path / "pause", 0.1)
    summary = run_steered_kill_then_join(run_dir, *TRAINER_ARGS, pace=pace)
    assert_completed_exactly_once(summary, steps=STEPS)
    # Every restart resumed from a DCP checkpoint written at another world size.
    resumes = worker_records(run_dir, "resume")
    assert {r["source"] for r in resumes if r["restored_step"] > 0} == {"disk"}
    # The reference: one fsdp2 process, no faults, no pause file (unpaced).
    assert_ends_like(summary, run_dir, tmp_path / "reference", TRAINER_ARGS)
