"""End to end: the real trainer on real torchrun nodes against a real etcd, with real faults.

One chaos run (3 nodes; node 1 killed, then joining again) serves three tests:
its audit, its final parameters against an uninterrupted run, and the join at a
step that evaluates. Its forwards pause 0.1 s until the rejoined world trains
(``steered_runs``), then not at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from chaos_runs import PACED_STEPS, assert_completed_exactly_once, log_events
from steered_runs import ENV, STEERED_MLP, Pace, assert_ends_like, run_steered_kill_then_join
from torch_support import needs_inprocess

STEPS = PACED_STEPS
#: Every step evaluates (a collective between steps), on a few samples
EVAL_EVERY_STEP = ["--eval.every_steps=1", "--eval.max_samples=12", "--eval.batch_size=4"]
TRAINER_ARGS = [*STEERED_MLP, *EVAL_EVERY_STEP]


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    """``elastic-train local --nodes 3`` with a kill at world size 3 and a join at 2."""
    run_dir = tmp_path_factory.mktemp("chaos")
    pace = Pace(run_dir.parent / f"{run_dir.name}-pause", 0.1)
    # A temporary directory of its own: what the run leaves there is the run's litter.
    tmp = tmp_path_factory.mktemp("chaos-tmp")
    # Without the session's PET_LOG_DIR (conftest.py): --log-dir is what's tested.
    env = {**{k: v for k, v in ENV.items() if k != "PET_LOG_DIR"}, "TMPDIR": str(tmp)}
    summary = run_steered_kill_then_join(run_dir, *TRAINER_ARGS, pace=pace, env=env)
    return summary, run_dir, tmp


@pytest.mark.slow
def test_kill_and_join_on_three_nodes_complete_exactly_once(
    chaos_run: tuple[dict, Path, Path],
) -> None:
    summary, run_dir, _ = chaos_run
    assert_completed_exactly_once(summary, steps=STEPS)
    assert f"{STEPS // 6} finished epochs" in summary["exactly_once_detail"]
    for recovery in summary["recoveries"]:
        assert recovery["seconds"] > 0 and recovery["lost_steps"] >= 0, recovery
    assert summary["nodes"] == {"node0": "exited(0)", "node1": "exited(0)", "node2": "exited(0)"}
    assert isinstance(summary["final_loss"], float)
    # steered_runs passes --no-timeline: the summary, and no picture (test_timeline.py
    # runs the default, which draws it)
    assert (run_dir / "summary.json").is_file() and not (run_dir / "timeline.png").exists()


@pytest.mark.slow
def test_the_agents_keep_their_torchrun_logs_in_the_run_dir_not_in_tmp(
    chaos_run: tuple[dict, Path, Path],
) -> None:
    _, run_dir, tmp = chaos_run
    # torchrun's default is a new torchelastic_* directory in $TMPDIR per agent, never removed.
    assert not list(tmp.glob("torchelastic_*")), sorted(p.name for p in tmp.iterdir())
    # One per agent started: the three nodes and the rejoined one.
    assert len(list((run_dir / "torchelastic").iterdir())) == 4


@pytest.mark.slow
def test_resized_run_ends_where_an_uninterrupted_run_does(
    chaos_run: tuple[dict, Path, Path], tmp_path: Path
) -> None:
    summary, run_dir, _ = chaos_run
    # The reference: the same config, one process (forked), no torchrun, no faults,
    # and no pause file (a sleep does not change the arithmetic).
    assert_ends_like(summary, run_dir, tmp_path / "reference", TRAINER_ARGS)


@needs_inprocess
@pytest.mark.slow
def test_a_join_at_a_step_that_evaluates_keeps_every_process(
    chaos_run: tuple[dict, Path, Path],
) -> None:
    """The members admit after the boundary's evaluation, run at the old size, and
    the joiner starts with the next step. Admitted before it, a member evaluated with
    the joiner while the joiner trained: gloo aborted the worker on the mismatch."""
    summary, run_dir, _ = chaos_run
    assert [r["restore_source"] for r in summary["recoveries"]] == ["inprocess", "inprocess"]
    node0 = run_dir / "logs" / "node0.log"
    (admitted,) = log_events(node0, "inprocess_admitted")
    sizes = {e["step"]: e["world_size"] for e in log_events(node0, "evaluation")}
    step = admitted["step"]
    assert (sizes[step], sizes[step + 1]) == (2, 3), (step, sizes)
