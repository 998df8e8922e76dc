"""Smoke versions of every benchmark (one repetition, tiny sizes), so the
benchmarks cannot rot: each runs end to end on real etcd/torchrun processes and
its JSON must hold the fields the README table is built from, with values that
make sense together (not merely "it ran")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import (
    checkpoint_cost,
    diagnose,
    goodput,
    goodput_score,
    group_swap,
    harness,
    join_heal,
    plots,
    preemption,
    recovery,
    rendezvous_scale,
    report,
    scaleup,
    startup_fault,
    workloads,
)
from benchmarks import throughput as throughput_bench

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def forked_agents(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes' agents fork from one launcher that imported torch once: a third of
    the CPU of a smoke run on 2 cores, which the other test file running beside it
    needs more than a smoke run needs the cluster's start-up (benchmarks.workloads)."""
    monkeypatch.setattr(workloads, "FORK_AGENTS", True)


def run(module: Any, out: Path, *args: str) -> dict[str, Any]:
    module.main(["--smoke", "--repeats=1", f"--out-dir={out}", f"--workdir={out / 'work'}", *args])
    name = module.__name__.rsplit(".", 1)[1]
    return json.loads((out / f"{name}_smoke.json").read_text())


def only_run(result: dict[str, Any], competitor: str) -> dict[str, Any]:
    outcome = result["runs"][competitor]
    assert outcome["unavailable"] is None
    (single,) = outcome["runs"]
    assert "error" not in single, single.get("trace")
    return single


def check_machine(result: dict[str, Any]) -> None:
    machine = result["machine"]
    assert machine["cpu_count"] >= 1 and machine["cpu_model"]
    assert machine["torch"].startswith("2.")
    assert result["finished"] >= result["started"]


def check_event(run_: dict[str, Any], *, kind: str, world_after: int, timeout: float) -> None:
    """The audited recovery is self-consistent: stages in order, before the first step."""
    assert run_["kind"] == kind and run_["world_size_after"] == world_after
    assert 0 < run_["seconds"] < timeout
    # "inprocess": the survivors kept their state (recovery "auto" under our plugin).
    assert run_["restore_source"] in ("disk", "snapshot", "none", "inprocess")
    assert run_["lost_steps"] >= 0
    assert 0 < run_["restored_seconds"] <= run_["seconds"]
    if run_["round_closed_seconds"] is not None:
        assert run_["round_closed_seconds"] <= run_["restored_seconds"]


def test_recovery_smoke_ours(tmp_path: Path) -> None:
    result = run(recovery, tmp_path, "--competitors=ours")
    check_machine(result)
    single = only_run(result, "ours")
    check_event(single, kind="kill", world_after=1, timeout=60)
    # the kill came after the warm-up, and work was resumed from a real step
    assert single["restored_step"] + single["lost_steps"] >= 5
    assert result["summary"]["ours"]["seconds"]["median"] == single["seconds"]
    names = [t["name"] for t in result["targets"]]
    assert "ours median recovery, s" in names and "ours max lost steps per failure" in names


def _agent_closes_the_rendezvous_on_sigterm() -> bool:
    """torch 2.6's ``LocalElasticAgent._shutdown(death_sig, is_restart)`` also shuts
    the rendezvous handler down on a signal, which closes torch's c10d rendezvous
    for every node (our etcd backend only leaves; later torch does neither)."""
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    return "is_restart" in inspect.signature(LocalElasticAgent._shutdown).parameters


@pytest.mark.skipif(
    _agent_closes_the_rendezvous_on_sigterm(),
    reason="this torch's agent closes the c10d rendezvous when one node is preempted",
)
def test_preemption_smoke_plain_c10d(tmp_path: Path) -> None:
    # torch's keep-alive expires a node after 2 s under the tuned settings, so on a
    # loaded CI box the two cold agents once pruned each other and formed two worlds
    # of 1 (benchmarks/README.md, "unsafe for membership changes"); 5 s keeps the
    # smoke about our harness, not that race.
    steady = "c10d-tuned:keep_alive_max_attempt=5"
    result = run(preemption, tmp_path, "--competitors=c10d-tuned", f"--rdzv-conf={steady}")
    assert result["rdzv_conf"]["c10d-tuned"] == (
        "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"
    )
    single = only_run(result, "c10d-tuned")
    check_event(single, kind="term", world_after=1, timeout=60)
    # the plain script saves every 25 steps: a restart before that resumes from scratch
    assert single["restored_step"] % 25 == 0


def test_startup_fault_smoke_ours(tmp_path: Path) -> None:
    result = run(startup_fault, tmp_path, "--competitors=ours")
    single = only_run(result, "ours")
    # the node died before the group: no step at two, and none lost
    assert not single["group_formed_before_kill"] and single["lost_steps"] == 0, single
    assert single["world_size_after"] == 1 and single["restore_source"] == "none"
    # the survivor did not wait out its store (either a prune, or it lost the store's host)
    assert 0 < single["seconds"] < startup_fault.STORE_TIMEOUT_S / 2, single


def test_scaleup_smoke_ours(tmp_path: Path) -> None:
    result = run(scaleup, tmp_path, "--competitors=ours")
    single = only_run(result, "ours")
    check_event(single, kind="join", world_after=2, timeout=60)
    # a planned resize: the survivors' state is current, nothing is redone
    assert single["restored_step"] >= 5


def test_join_heal_smoke(tmp_path: Path) -> None:
    # the heal alone: the broadcast variant is the same measure of another config
    result = run(join_heal, tmp_path, "--competitors=heal")
    single = only_run(result, "heal")
    # the join came after the warm-up; a step time and a stall were measured
    assert single["switch_step"] >= 5 and single["step_ms"] > 0 and single["switch_ms"] > 0
    assert single["stall_steps"] == pytest.approx(single["stall_ms"] / single["step_ms"])
    # rank 0 sent the model and the optimizer: the MLP's parameters and AdamW's
    # two moments, over 3 x 4 bytes per weight
    assert single["state_bytes"] > 12 * (32 * 256 + 256 * 256 + 256 * 8)
    (target,) = result["targets"]
    assert target["value"] == pytest.approx(single["stall_steps"])


def test_throughput_smoke(tmp_path: Path) -> None:
    pytest.importorskip("etcd", reason="etcd-v2 needs python-etcd (the bench extra)")
    result = run(throughput_bench, tmp_path, "--competitors=ours,etcd-v2-tuned")
    ours, plain = only_run(result, "ours"), only_run(result, "etcd-v2-tuned")
    for single in (ours, plain):
        assert single["samples_per_second"] == pytest.approx(single["steps_per_second"] * 64)
        assert single["window_seconds"] > 0
    (target,) = result["targets"]
    expected = ours["samples_per_second"] / plain["samples_per_second"]
    assert target["value"] == pytest.approx(expected)
    assert result["ratios"]["etcd-v2-tuned"] == pytest.approx(1 / expected)
    paired = result["summary"]["etcd-v2-tuned"]["paired_ratio"]
    assert (paired["median"], paired["n"]) == (pytest.approx(1 / expected), 1)


def test_checkpoint_cost_smoke(tmp_path: Path) -> None:
    result = run(checkpoint_cost, tmp_path)
    summary = result["summary"]
    for name in ("large-sync", "large-async", "large-torch_save"):
        single = only_run(result, name)
        assert single["saves"] == 3  # 3 warm-up + 12 timed steps, every 4th step
        assert single["blocked_seconds_per_save"] > 0
        assert single["save_seconds_per_save"] > 0
    snapshot = only_run(result, "small-snapshot")
    assert snapshot["saves"] == 15  # every step, warm-up included
    assert only_run(result, "large-none")["state_mb"] > only_run(result, "small-none")["state_mb"]
    for name in ("large-sync", "large-async", "small-snapshot"):
        assert summary[name]["throughput_loss"]["median"] is not None
    excess = {n: only_run(result, n)["excess_fraction"] for n in ("large-none", "large-sync")}
    in_run = summary["large-sync"]["in_run_loss"]["median"]
    assert in_run == pytest.approx(excess["large-sync"] - excess["large-none"])
    # The 3 saves of the 12 timed steps block inside their steps; the median
    # is a step without a save (unless 3 of the other 9 stall), so the time
    # above 12 x median holds the 3 blocked saves, less only the spread of the
    # plain steps below the median (far below one save), whatever the box's
    # speed that moment.
    sync = only_run(result, "large-sync")
    excess_seconds = sync["excess_fraction"] * sync["window_seconds"]
    assert excess_seconds > sync["later_saves_blocked_seconds"], sync
    assert summary["small-snapshot"]["in_run_loss"]["median"] is None  # no step without a save
    assert {t["name"] for t in result["targets"]} >= {"async saves lose, fraction within runs"}


def test_diagnose_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run(diagnose, tmp_path, "--competitors=ours")
    single = only_run(result, "ours")
    cpu = single["cpu_us_per_step"]
    # Both nodes' workers and agents are found, and the workers did the training.
    assert {"worker node0", "worker node1", "agent node0", "agent node1"} <= set(cpu), cpu
    assert all(cpu[f"worker node{i}"] > cpu[f"agent node{i}"] for i in (0, 1)), cpu
    profile = single["step_us_by_position"]
    assert set(profile) == {"rank 0", "rank 1"}
    assert all(len(means) == 4 and min(means) > 0 for means in profile.values()), profile
    assert "| ours | worker node0 |" in capsys.readouterr().out


def test_rendezvous_scale_smoke(tmp_path: Path) -> None:
    pytest.importorskip("etcd", reason="etcd-v2 needs python-etcd (the bench extra)")
    result = run(rendezvous_scale, tmp_path)
    block = result["by_agents"]["2"]
    for name in ("ours", "c10d-tuned", "etcd-v2-tuned"):
        single = only_run(block, name)
        assert single["round_seconds"] > 0 and single["rerendezvous_seconds"] > 0
        # torch's handlers write each agent in; ours may fold both joins into one write.
        assert single["round_state_writes"] >= (1 if name == "ours" else 2)
        assert single["backend_calls_per_agent_per_s"] > 0
        idle = single["idle_requests_per_agent_per_s"]
        if name == "c10d-tuned":
            assert idle is None  # no request counter on a TCPStore
        elif name == "ours":
            assert idle == 0  # polls answered from the watched copy, no heartbeats
        else:
            # etcd's own counter saw the idle polling (over a short window, so
            # it only roughly matches the backend calls counted in-process)
            assert 0 < idle < 3 * single["backend_calls_per_agent_per_s"]


def test_report_renders_tables_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(checkpoint_cost, tmp_path)
    capsys.readouterr()
    report.main(["--smoke", f"--results-dir={tmp_path}"])
    text = capsys.readouterr().out
    assert "| large-async |" in text and "async saves lose, fraction" in text
    png = tmp_path / "checkpoint_cost_smoke.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.START}\nold\n{report.END}\noutro\n")
    report.update_readme("| new | table |", readme)
    assert readme.read_text() == f"intro\n{report.START}\n| new | table |\n{report.END}\noutro\n"


def test_paired_ratios_divide_within_each_repetition() -> None:
    """Drift between repetitions cancels in the pairs, not in the medians."""
    speeds = {"ours": [100.0, 50.0, 80.0], "plain": [110.0, 55.0, 60.0]}
    outcomes = {
        name: harness.Outcome(name, runs=[{"repeat": r, "x": v} for r, v in enumerate(values)])
        for name, values in speeds.items()
    }
    outcomes["plain"].runs.append({"repeat": 3, "error": "hung"})  # no pair: not counted
    summary = harness.summarize_outcomes(outcomes, ["x"])
    harness.add_paired_ratios(summary, outcomes, metric="x")
    paired = summary["plain"]["paired_ratio"]
    assert (paired["median"], paired["min"], paired["max"], paired["n"]) == (
        pytest.approx(1.1),
        pytest.approx(0.75),
        pytest.approx(1.1),
        3,
    )
    assert summary["plain"]["x"]["median"] / summary["ours"]["x"]["median"] == pytest.approx(0.75)
    assert summary["ours"]["paired_ratio"]["median"] == 1.0
    target = throughput_bench.targets({"ours": summary["ours"], "c10d-tuned": summary["plain"]})
    assert target[0].value == pytest.approx(1 / 1.1)
    # Ours without snapshots 1.1 times as fast, pair by pair: the default cadence costs 1/11.
    variant = {"ours": summary["ours"], "ours-no-snapshot": summary["plain"]}
    (snapshots,) = [
        t for t in throughput_bench.targets(variant) if t.name == "default snapshots lose"
    ]
    assert snapshots.value == pytest.approx(1 - 1 / 1.1)


def test_goodput_smoke_ours(tmp_path: Path) -> None:
    # A 3 s fault-free window (the smoke's default is 6 s): it only has to hold
    # steady steps, and steps of this workload take milliseconds.
    result = run(goodput, tmp_path, "--competitors=ours", "--fault-free-minutes=0.05")
    check_machine(result)
    free, soak = only_run(result, "ours-fault-free"), only_run(result, "ours")
    schedule = [(e["kind"], e["at_seconds"]) for e in result["settings"]["schedule"]]
    assert schedule == [("kill", 3.0), ("join", 6.0)]
    kill, join = soak["events"]
    assert kill["outcome"] == join["outcome"] == "delivered" and kill["node"] == join["node"]
    assert kill["seconds"] > 0 and kill["lost_steps"] >= 0, kill
    # Useful steps are the committed full steps inside the window, each once.
    assert sum(soak["steps_per_bin"]) == soak["useful_steps"] > 0
    assert soak["useful_steps"] <= soak["recorded_steps"]
    # nothing thrown away; only the step in flight at the end lacks a rank's record
    assert free["recorded_steps"] - free["useful_steps"] <= 1
    assert soak["separate_run_steps_per_second"] == free["useful_steps_per_second"]
    expected = soak["useful_steps_per_second"] / free["useful_steps_per_second"]
    assert soak["goodput_separate_run"] == pytest.approx(expected)
    quiet = soak["quiet_steps_per_second"]
    assert soak["goodput"] == pytest.approx(soak["useful_steps_per_second"] / max(quiet.values()))
    (target,) = result["targets"]
    assert (target["value"], target["limit"], target["kind"]) == (soak["goodput"], 0.98, "min")
    row = next(r for r in report.goodput_table(result) if r.startswith("| ours |"))
    assert f"| {soak['goodput']:.3f} |" in row
    png = tmp_path / "goodput.png"
    plots.figure("goodput", result, "goodput").savefig(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goodput_schedule_alternates_seeded_kills_and_rejoins() -> None:
    events = goodput.soak_schedule(seconds=600, every=30, seed=7)
    assert [e.at_seconds for e in events] == [30.0 * i for i in range(1, 20)]
    assert all(e.kind == ("kill" if i % 2 == 0 else "join") for i, e in enumerate(events))
    assert all(k.node == j.node for k, j in zip(events[::2], events[1::2], strict=False))
    assert events == goodput.soak_schedule(seconds=600, every=30, seed=7)
    nodes = {e.node for s in range(5) for e in goodput.soak_schedule(seconds=600, every=30, seed=s)}
    assert nodes == {0, 1, 2}  # every node gets killed, rank 0's included


def test_goodput_divides_by_the_faster_quiet_world() -> None:
    """A dead node's absence is no gain: where 2 workers step faster than 3 (fewer
    cores than workers), the 2-node rate is the denominator; the quiet segments
    are the last third of each interval, the recoveries' bins are not."""
    schedule = [{"kind": "kill", "node": 1, "at_seconds": 30.0},
                {"kind": "join", "node": 1, "at_seconds": 60.0}]  # fmt: skip
    # 1 s bins: 100 steps/s at 3 nodes, 125 at 2, nothing for 2 s after each event
    bins = [100] * 30 + [0, 0] + [125] * 28 + [0, 0] + [100] * 28
    soak = {"repeat": 0, "steps_per_bin": bins, "bin_seconds": 1.0, "window_seconds": 90.0,
            "useful_steps_per_second": sum(bins) / 90.0}  # fmt: skip
    assert goodput_score.quiet_rates(soak, schedule) == {3: 100.0, 2: 125.0}
    stuck = {**soak, "steps_per_bin": [*bins[:55], 0, *bins[56:]]}  # a stall at 55 s
    assert goodput_score.quiet_rates(stuck, schedule) == {3: 100.0}
    free = {"ours-fault-free": 90.0, "ours-fault-free-2": 95.0}
    payload = {
        "settings": {"schedule": schedule, "fault_free_worlds": [3, 2]},
        "runs": {"ours": {"unavailable": None, "runs": [soak]}}
        | {n: {"unavailable": None, "runs": [{"repeat": 0, "useful_steps_per_second": r}]}
           for n, r in free.items()},
    }  # fmt: skip
    goodput_score.score(payload)
    assert soak["goodput"] == pytest.approx(sum(bins) / 90.0 / 125.0)
    assert soak["goodput_separate_run"] == pytest.approx(sum(bins) / 90.0 / 95.0)
    assert soak["goodput_full_world"] == pytest.approx(sum(bins) / 90.0 / 90.0)
    (target,) = payload["targets"]
    assert target["value"] == soak["goodput"] and target["met"] is False


def test_group_swap_smoke(tmp_path: Path) -> None:
    """The next group formed in the background on torch's private group API:
    the joiner ends with the members' parameters in both variants, and each
    stall is accounted for by its parts."""
    result = run(group_swap, tmp_path)
    check_machine(result)
    for name in ("reinit", "background"):
        single = only_run(result, name)
        assert single["max_param_diff_between_ranks"] == 0.0, name
        parts = single["before_switch_ms"] + single["switch_ms"] + single["first_step_extra_ms"]
        assert single["stall_ms"] == pytest.approx(parts), name
    assert only_run(result, "background")["formation_ms"] > 0
    (target,) = result["targets"]
    assert target["limit"] == group_swap.TARGET_STALL_STEPS and target["value"] is not None
