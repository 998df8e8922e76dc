"""A node lost between the rendezvous round and the first process group.

Its workers never reach the group, so no collective of the survivors fails: they
wait for it at their store. Until the round settled (``rendezvous/settling.py``)
nothing told them the node was dead rather than slow, and they waited out
``pg_timeout_seconds`` (57 s from the kill to the next step, measured). Now the
agents heartbeat until their workers formed the group, the survivors' agents
find the dead node's heartbeats stale and end the round, and the survivors
restart without it. Real processes: ``elastic-train local``, three nodes, one of
them SIGKILLed (agent, zygote and worker) while its worker builds its model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chaos_runs import assert_ran_exactly_once, run_chaos, worker_records

STEPS = 30
#: the workers' store and group timeout: the survivors would wait it out before
PG_TIMEOUT_S = 60.0


@pytest.mark.slow
def test_a_node_lost_before_its_first_group_is_left_behind_in_seconds(tmp_path: Path) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "died.json"
    summary = run_chaos(
        run_dir, ["--nodes", "3", "--min-nodes", "2"],
        "--data.name=synthetic", "--data.num_samples=96", "--training.global_batch_size=16",
        f"--training.steps={STEPS}", "--training.micro_batch_size=0",
        "--model.name=tests.fault_hooks:probe_mlp", f"--model.options.die_before_group={marker}",
        f"--elastic.pg_timeout_seconds={PG_TIMEOUT_S}",
    )  # fmt: skip
    assert_ran_exactly_once(summary, steps=STEPS)
    died = json.loads(marker.read_text())
    steps = worker_records(run_dir, "step")
    assert {r["node"] for r in steps} == {"node0", "node1", "node2"} - {died["node"]}, died
    first = min(r["time"] for r in steps)
    # Heartbeats stale after 3 s, a restart, a round, a warm start: seconds, not the
    # store timeout that the survivors' workers would otherwise have waited out.
    assert first - died["time"] < PG_TIMEOUT_S / 2, (first - died["time"], died)
