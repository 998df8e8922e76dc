"""A peer that stops in the first step after a re-form is found at the step timeout.

Real ``elastic-train local`` nodes (torchrun agents, an embedded etcd), in-process
recovery: the node of rank 2 is SIGKILLed at step 8; the two survivors re-form;
in their first step at world size 2, rank 1 SIGSTOPs itself before its all-reduce
(``fault_hooks.probe_mlp``'s ``stop_first_step_at_world``). Rank 0 then waits in
the all-reduce of a group's first step, where nothing but the collective's
timeout wakes it. Every member of that group stepped before, so its first step
is bounded too (``StepTimeout.attach(warm=True)``): rank 0 re-forms alone, in
process, long before the watchdog (4-5 s here, with a 2 s floor). When the first step kept
``pg_timeout_seconds`` (60 s), the watchdog (30 s here) fired first and the
worker went down the restart path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chaos_runs import assert_ran_exactly_once, run_chaos, worker_events
from torch_support import needs_inprocess

STEPS = 24
#: an explicit watchdog timeout: the step timeout stays under half of it
WATCHDOG_S = 30.0
JOB = [
    "--data.name=synthetic",
    "--data.num_samples=96",  # 6 steps an epoch
    "--training.global_batch_size=16",
    f"--training.steps={STEPS}",
    "--training.micro_batch_size=0",  # one backward a step, as the probe needs
    "--checkpoint.interval_steps=4",
    "--elastic.snapshot_every_steps=1",
    "--elastic.recovery=inprocess",
    f"--elastic.watchdog_timeout_seconds={WATCHDOG_S}",
    # the first step's bound is then 2 x max(2 s, 10 x the median step) instead of
    # 10 s: the same property, seconds sooner
    "--elastic.inprocess_timeout_floor_seconds=2",
    "--model.name=tests.fault_hooks:probe_mlp",
    "--model.options.allreduce_pause_s=0.1",  # step times the step timeout can follow
    "--model.options.stop_first_step_at_world=2",
]


@pytest.mark.slow
@needs_inprocess
def test_a_peer_stopped_in_the_first_step_after_a_re_form_is_removed_at_the_step_timeout(
    tmp_path: Path,
) -> None:
    marker, run_dir = tmp_path / "stopped.json", tmp_path / "run"
    # --finish-grace: the frozen worker never exits by itself
    cluster = ["--nodes", "3", "--min-nodes", "1", "--chaos", "kill:rank2@step8",
               "--finish-grace", "3"]  # fmt: skip
    summary = run_chaos(run_dir, cluster, *JOB, f"--model.options.stop_marker={marker}")
    assert_ran_exactly_once(summary, steps=STEPS)
    assert marker.is_file(), "no worker stopped in a first step at world size 2"
    stopped = json.loads(marker.read_text())

    def survivor(name: str) -> list[dict]:
        return [e for e in worker_events(run_dir, name) if e["node"] != stopped["node"]]

    hangs = survivor("worker_hang_detected")
    assert not hangs, hangs  # the watchdog, not the step timeout, ended the wait
    # By the world size of the group they left (the stopped worker may stop before
    # the survivor logs the end of the first recovery).
    (started,) = [e for e in survivor("inprocess_recovery_started") if e["world_size"] == 2]
    (recovered,) = [e for e in survivor("inprocess_recovered") if e["world_size"] == 1]
    # The failed step was the group's first, and its limit was the step timeout's,
    # not pg_timeout_seconds (60 s).
    assert started["step_timeout_s"] <= WATCHDOG_S / 2, started
    assert recovered["lost_steps"] <= 1, recovered
    assert recovered["time"] - stopped["time"] < WATCHDOG_S, (stopped, recovered)
    (agreed,) = [e for e in survivor("membership_agreed") if e["world_size"] == 2]
    assert [m.split("/")[0] for m in agreed["dead"]] == [stopped["node"]], agreed
