"""The faults that recovery must survive (issue 20, item 6), with real processes.

Real ``elastic-train local`` nodes (torchrun agents, an embedded etcd), real
SIGKILL and SIGSTOP from the chaos schedule, in both recovery modes: the
restart path (``--elastic.recovery=restart``) and in process.

One run of five nodes (and node5, which joins) per mode holds the faults:

- ``join:5@step8,kill:rank0@step8``: the node of rank 0 dies *inside its
  gradient all-reduce* (``fault_hooks.probe_mlp``: every other rank pauses just
  before its all-reduce, so rank 0 spends each step waiting inside it; its probe
  file shows it entered and never left), and node5 starts milliseconds later,
  while the survivors recover;
- ``kill:rank0@step16+save``: the node of rank 0 dies while it writes a
  checkpoint (the runner froze it holding a partial save's file open);
- ``kill:rank1@step30,kill:rank2@step30``: two nodes killed milliseconds apart
  (at least three are left by then, whenever node5 gets in);
- in-process only, ``stop:rank1@step45``: a worker of the two left is SIGSTOPped;
  the other's step timeout ends the hang and it goes on alone, in the same
  process (the restart path's hang test is test_chaos_faults').

Each run completes with every sample exactly once and ends with the final
parameters of a fault-free run (one reference, forked once for both runs).
Once the faults have played out, the test ends the pace (``pause_file``): the
steps left only cost wall time. Per-step snapshots bound every kill to one lost
step. ``pg_timeout_seconds`` stays at its default (60 s): in-process, a survivor
that gloo leaves waiting in a receive wakes at the adaptive step timeout instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from chaos_runs import (
    assert_ran_exactly_once,
    assert_same_end,
    log_events,
    worker_events,
    worker_records,
)
from fault_hooks import probe_lines
from steered_runs import Pace, forked_reference, run_steered
from torch_support import needs_inprocess

from elastic_train.audit import AuditTail, StepRecord
from elastic_train.config.load import load_config
from elastic_train.errors import ConfigError
from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.training.step_timeout import StepTimeout

#: 15 epochs: the steps after the last kill are the slack for a slow joiner.
STEPS = 90
JOB = [
    "--data.name=synthetic",
    "--data.num_samples=96",  # 6 steps an epoch
    "--training.global_batch_size=16",
    f"--training.steps={STEPS}",
    "--training.final_loss_samples=96",
    "--training.micro_batch_size=0",  # one backward a step, as the probe needs
    "--checkpoint.interval_steps=3",
    "--checkpoint.keep=100",  # the checkpoint before the interrupted save stays to be checked
    "--elastic.snapshot_every_steps=1",  # every step is in a snapshot: at most 1 lost
    "--model.name=tests.fault_hooks:probe_mlp",
    # 8 MiB of frozen weights: a save takes tens of ms, long enough to catch,
    # and the per-step snapshot stays short (rank 0 is outside its all-reduce then)
    "--model.options.ballast_mib=8",
]
#: the chaos runs' pace until the faults are over (rank 0 waits this long inside every
#: all-reduce)
PAUSE_S = 0.15
#: the in-process run's pause from step 20 on while the joiner's worker is not in yet
JOIN_WAIT_S = 1.0
PACED = [
    f"--model.options.allreduce_pause_s={PAUSE_S}", "--model.options.probe_dir={run_dir}/probe",
    # kill:rank0@step8 fires once step 8 is recorded, which every rank does before its
    # all-reduce: rank 0 then waits 2 s inside step 8's, however late the runner looks
    "--model.options.hold_at_step=8", "--model.options.hold_s=2",
]  # fmt: skip
KILLS = "join:5@step8,kill:rank0@step8,kill:rank0@step16+save,kill:rank1@step30,kill:rank2@step30"
#: in-process only: a worker of the two nodes left is frozen
STOP = "stop:rank1@step45"
#: an explicit watchdog timeout, so the hang's bound is known
WATCHDOG_S = 20.0
#: the default process-group timeout, which in-process detection must not wait for
PG_TIMEOUT_S = 60.0
MODES = ("restart", "inprocess")
#: the mode's chaos schedule and extra options
FIVE_NODES = {
    "restart": ([KILLS], ()),
    # --finish-grace: the frozen worker never exits by itself, and the runner would wait
    # 15 s for it after the end
    "inprocess": ([f"{KILLS},{STOP}"],
                  ("--finish-grace", "3", f"--elastic.watchdog_timeout_seconds={WATCHDOG_S}")),
}  # fmt: skip
Reference = tuple[dict[str, torch.Tensor], float]


def _run(
    run_dir: Path, mode: str, cluster: list[str], *extra: str,
    pause: Callable[[list[StepRecord]], float],
) -> dict:  # fmt: skip
    """``elastic-train local`` through ``cluster``'s faults; the pause each step takes
    is ``pause(the step records so far)``, and once it is 0 it stays 0."""
    pace = Pace(run_dir.parent / f"{run_dir.name}-pause", PAUSE_S)
    tail, steps, paced = AuditTail(run_dir / "audit"), list[StepRecord](), [PAUSE_S]

    def tick() -> None:
        if paced[0]:
            steps.extend(r for r in tail.poll() if isinstance(r, StepRecord))
            seconds = pause(steps)
            if seconds != paced[0]:
                pace.set(seconds)
                paced[0] = seconds

    command = [*cluster, "--run-dir", str(run_dir), "--timeout", "240", "--metrics-port", "0",
               *JOB, *PACED, f"--model.options.pause_file={pace.path}",
               f"--elastic.recovery={mode}", *extra]  # fmt: skip
    # nodes=0: no world of 0 trains, so run_steered's own rejoin watch never ends the pause
    return run_steered(run_dir, command, pace=pace, nodes=0, on_tick=tick)


def _kills_done(steps: list[StepRecord]) -> bool:
    # Only the two kills at step 30 leave a world of 2 (node2 and node5); node5 in it
    # means the join landed too.
    return any(s.node == "node5" and s.world_size == 2 and s.step > 30 for s in steps)


def _restart_pause(steps: list[StepRecord]) -> float:
    return 0.0 if _kills_done(steps) else PAUSE_S


def _inprocess_pause(steps: list[StepRecord]) -> float:
    if any(s.world_size == 1 and s.step > 45 for s in steps):  # one left after the stop
        return 0.0
    # The kills at step 30 must find node5 in the group (its worker starts in 3-4 s
    # on a quiet box, 7-10 s on a loaded one): until it trains, the steps from 20 on
    # are slow, and its admission still comes at a step boundary.
    joined = any(s.node == "node5" for s in steps)
    return JOIN_WAIT_S if not joined and any(s.step >= 20 for s in steps) else PAUSE_S


@pytest.fixture(
    scope="module",
    params=[pytest.param(m, marks=needs_inprocess) if m == "inprocess" else m for m in MODES],
)
def five_nodes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    mode = request.param
    run_dir = tmp_path_factory.mktemp(f"faults-{mode}")
    chaos, extra = FIVE_NODES[mode]
    cluster = ["--nodes", "5", "--min-nodes", "1", "--chaos", *chaos]
    pause = _inprocess_pause if mode == "inprocess" else _restart_pause
    return _run(run_dir, mode, cluster, *extra, pause=pause), run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """One process, no torchrun, no faults, no pause, no probe: final params and loss."""
    return forked_reference(tmp_path_factory.mktemp("reference"), [*JOB, "--checkpoint.keep=1"])


def _events(summary: dict) -> dict[str, dict]:
    events = {event["event"]: event for event in summary["events"]}
    assert all(e["outcome"] == "delivered" for e in events.values()), summary["events"]
    return events


def _recovery(summary: dict, event: dict) -> dict:
    (found,) = [r for r in summary["recoveries"] if r["event_time"] == event["time"]]
    return found


@pytest.mark.slow
def test_five_nodes_through_four_faults_end_like_a_fault_free_run(
    five_nodes: tuple[dict, Path], reference: Reference
) -> None:
    summary, run_dir = five_nodes
    assert_ran_exactly_once(summary, steps=STEPS)
    assert_same_end(summary, run_dir, *reference)
    for recovery in summary["recoveries"]:
        if recovery["kind"] == "kill":  # a snapshot of the step before the one in flight
            assert recovery["lost_steps"] is not None and recovery["lost_steps"] <= 1, recovery
    # Four kills of six nodes (the frozen one, in-process, is none of them).
    stopped = {f"node{e['node']}" for e in summary["events"] if e["event"] == STOP}
    ends = [end for node, end in summary["nodes"].items() if node not in stopped]
    assert ends.count("killed") == 4, summary["nodes"]


@pytest.mark.slow
def test_rank0_died_inside_its_allreduce(five_nodes: tuple[dict, Path]) -> None:
    summary, run_dir = five_nodes
    kill = _events(summary)["kill:rank0@step8"]
    probes = probe_lines(run_dir / "probe")
    node = f"probe-node{kill['node']}-"
    # The node's worker at the kill: of its workers (one per start), the latest to write.
    victim = max((lines for name, lines in probes.items() if name.startswith(node)),
                 key=lambda lines: lines[-1]["time"])  # fmt: skip
    last = victim[-1]
    # It entered its all-reduce as rank 0 before the kill and never reached the optimizer.
    assert (last["event"], last["rank"]) == ("enter", 0), victim[-3:]
    assert last["time"] < kill["time"]
    assert _recovery(summary, kill)["lost_steps"] <= 1


@pytest.mark.slow
def test_a_join_landed_while_the_survivors_recovered(five_nodes: tuple[dict, Path]) -> None:
    summary, run_dir = five_nodes
    events = _events(summary)
    join, kill = events["join:5@step8"], events["kill:rank0@step8"]
    first_step_after_kill = kill["time"] + _recovery(summary, kill)["seconds"]
    assert kill["time"] < join["time"] < first_step_after_kill
    steps = [json.loads(line) for p in (run_dir / "audit").glob("worker-node5-*.jsonl")
             for line in p.read_text().splitlines()]  # fmt: skip
    assert any(s.get("kind") == "step" for s in steps), "node5 never trained"


@pytest.mark.slow
def test_a_kill_during_a_save_keeps_the_last_good_checkpoint(
    five_nodes: tuple[dict, Path],
) -> None:
    summary, run_dir = five_nodes
    kill = _events(summary)["kill:rank0@step16+save"]
    partial = kill["detail"].removeprefix("partial save ")
    assert partial.startswith(".tmp-step-") and "/" in partial, kill  # a file inside it
    interrupted = int(partial.split("-")[2])
    checkpoints = run_dir / "checkpoints"
    assert not list(checkpoints.glob(".tmp-step-*"))  # the next writer removed the partial
    recovery = _recovery(summary, kill)
    assert recovery["lost_steps"] <= 1, recovery
    # The partial never counts: nothing was restored from a disk save of its step.
    assert not (recovery["restore_source"] == "disk" and recovery["restored_step"] == interrupted)
    # The new rank 0's node agent writes from then on: the re-form gave the new
    # checkpoint manager the node's snapshots (it used to fall back to the trainer).
    logs = "\n".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "no snapshot store on this node" not in logs
    last_good = max(s for s in _complete_steps(checkpoints) if s < interrupted)
    manifest = json.loads((checkpoints / f"step-{last_good:09d}" / "MANIFEST.json").read_text())
    manager = CheckpointManager(
        checkpoints, keep=100, fingerprint=manifest["body"]["fingerprint"], is_writer=False
    )
    state = manager.load(last_good, map_location="cpu")  # verifies its checksum first
    assert state["step"] == last_good


def _complete_steps(checkpoints: Path) -> list[int]:
    return [int(p.parent.name.split("-")[1]) for p in checkpoints.glob("step-*/MANIFEST.json")]


@pytest.mark.slow
def test_two_kills_within_100ms(five_nodes: tuple[dict, Path]) -> None:
    summary, run_dir = five_nodes
    events = _events(summary)
    first, second = events["kill:rank1@step30"], events["kill:rank2@step30"]
    assert first["node"] != second["node"]
    assert abs(first["time"] - second["time"]) < 0.1, (first, second)
    one, other = _recovery(summary, first), _recovery(summary, second)
    assert one == {**other, "node": one["node"], "event_time": one["event_time"],
                   "seconds": one["seconds"]}  # fmt: skip  # one recovery from both
    assert one["lost_steps"] <= 1, one
    # Both are gone for good: no step of theirs after the kills.
    later = [r for r in worker_records(run_dir, "step") if r["time"] > first["time"]]
    assert not [r for r in later if r["node"] in (f"node{first['node']}", f"node{second['node']}")]


@pytest.mark.slow
def test_kills_recover_in_process_long_before_the_pg_timeout(
    five_nodes: tuple[dict, Path],
) -> None:
    # pg_timeout_seconds is 60 s here. A SIGKILL's survivors fail at once: the
    # dead peer's sockets close, and so do those of each survivor that leaves, as
    # long as nothing keeps a broken group's backend alive (step_timeout._set_timeout:
    # a version that kept it left the ranks two away waiting for a timeout).
    summary, run_dir = five_nodes
    if "inprocess" not in run_dir.name:
        pytest.skip("in-process recovery only")
    events = _events(summary)
    for name in ("kill:rank0@step16+save", "kill:rank1@step30"):
        recovery = _recovery(summary, events[name])
        why = _after(run_dir, events[name]["time"])
        assert recovery["restore_source"] == "inprocess", (recovery, why)
        assert recovery["seconds"] < PG_TIMEOUT_S / 3, (recovery, why)


#: the log events that tell how a recovery went, for a failing assertion's message
_RECOVERY_EVENTS = (
    "inprocess_recovery_started", "membership_agreed", "inprocess_reform_failed",
    "inprocess_recovery_failed", "inprocess_recovered", "worker_hang_detected",
)  # fmt: skip


def _after(run_dir: Path, since: float) -> list[str]:
    """Every process's resume records and recovery log events after ``since``, in time
    order: what a failing assertion about that recovery shows."""
    found = [(r["time"], f"resume {r['node']} {r['source']} world {r['world_size']} "
                         f"attempt {r['attempt']}")
             for r in worker_records(run_dir, "resume") if r["time"] > since]  # fmt: skip
    for name in _RECOVERY_EVENTS:
        found += [(e["time"], f"{e['node']} {name} {e.get('members') or e.get('error', '')}")
                  for e in worker_events(run_dir, name) if e["time"] > since]  # fmt: skip
    return [f"+{t - since:.2f}s {line}" for t, line in sorted(found)]


@pytest.mark.slow
def test_a_stopped_worker_is_removed_in_process_within_the_watchdog_bound(
    five_nodes: tuple[dict, Path],
) -> None:
    # The survivor, blocked in its all-reduce, wakes at the step timeout (5 s floor,
    # under half the watchdog's), finds the stopped peer silent and re-forms alone:
    # no watchdog exit, no worker restart.
    summary, run_dir = five_nodes
    if "inprocess" not in run_dir.name:
        pytest.skip("in-process recovery only")
    event = _events(summary)[STOP]
    stop = _recovery(summary, event)
    why = _after(run_dir, event["time"])
    assert stop["kind"] == "stop" and stop["world_size_after"] == 1, (stop, why)
    assert stop["lost_steps"] <= 1 and stop["restore_source"] == "inprocess", (stop, why)
    assert stop["seconds"] < WATCHDOG_S, stop
    # The stopped worker, resumed at the end, may still log: its watchdog firing,
    # or its own recovery finding it fenced out. The survivor's logs are checked.
    stopped = f"node{stop['node']}"
    survivor = [e for e in worker_events(run_dir, "worker_hang_detected") if e["node"] != stopped]
    assert not survivor, survivor
    (agreed,) = [e for e in worker_events(run_dir, "membership_agreed")
                 if e["node"] != stopped and e["time"] > event["time"]]  # fmt: skip
    assert [m.split("/")[0] for m in agreed["dead"]] == [stopped], agreed
    # The frozen node never exits by itself: the runner stopped it after --finish-grace.
    runner_log = run_dir.parent / f"{run_dir.name}-local.stderr"
    (left,) = log_events(runner_log, "local_nodes_left_after_finish")
    assert left["grace_s"] == 3.0, left
    # Exactly once and the fault-free end: test_five_nodes_through_four_faults_...


# -- the step timeout, the config ---------------------------------------------------


def test_the_step_timeout_follows_the_step_time_under_half_the_watchdog() -> None:
    now, watchdog = [0.0], [60.0]
    timeout = StepTimeout(full_s=PG_TIMEOUT_S, multiple=10.0, floor_s=2.0,
                          watchdog=lambda: watchdog[0], clock=lambda: now[0])  # fmt: skip
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))  # fmt: skip
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        if not hasattr(backend, "_set_default_timeout") or not hasattr(backend, "options"):
            pytest.skip("this torch cannot set or read a gloo group's timeout")
        timeout.attach("gloo")

        def step(seconds: float) -> float:
            """One step of ``seconds``; the group's timeout while it ran."""
            timeout.step_started()
            in_force = backend.options._timeout.total_seconds()
            now[0] += seconds
            timeout.step_done()
            assert backend.options._timeout.total_seconds() == PG_TIMEOUT_S  # between steps
            return in_force

        # The full limit until three intervals are known; then 10 x the median.
        assert [step(0.5) for _ in range(5)] == [PG_TIMEOUT_S] * 4 + [5.0]
        assert step(0.1) == 5.0  # the median, not the last one
        assert [step(0.1) for _ in range(20)][-1] == 2.0  # the floor
        watchdog[0] = 3.0
        assert step(0.1) == 1.5  # half the watchdog's
        watchdog[0] = 60.0
        timeout.widen()  # a step timeout that killed nobody
        assert step(0.1) == 4.0
        timeout.attach("gloo", scale=2.0)  # a new group of half the world
        assert [step(0.1) for _ in range(2)] == [PG_TIMEOUT_S, 4.0]  # its first step: full
        timeout.floor_s = 1.0
        assert step(0.1) == 2.0  # 10 x 0.1 s x 2
        # A failure's re-form whose members all stepped before: its first step gets
        # twice the bound (new loader workers, DDP's first buckets), not the full limit.
        timeout.attach("gloo", warm=True)
        assert [step(0.1) for _ in range(2)] == [4.0, 2.0]
        off = StepTimeout(full_s=PG_TIMEOUT_S, multiple=0.0, floor_s=2.0, watchdog=None,
                          clock=lambda: now[0])  # fmt: skip
        off.attach("gloo")
        timeout = off
        assert [step(0.1) for _ in range(5)] == [PG_TIMEOUT_S] * 5  # 0: never shortened
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "arg", ["inprocess_timeout_multiple=-1", "inprocess_timeout_floor_seconds=0"]
)
def test_a_bad_step_timeout_key_is_named(arg: str) -> None:
    key = arg.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"elastic\.{key}"):
        load_config(None, [f"elastic.{arg}"])
