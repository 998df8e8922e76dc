"""Goodput soak: three nodes train for ``--minutes`` while a seeded schedule kills
a random node every other ``--every`` seconds and restarts it ``--every`` seconds
later, for ``ours`` and ``c10d-tuned`` (torchrun c10d, tuned, driving the plain
DDP script) in the same run.

    python -m benchmarks.goodput --minutes 10 --every 30          # results/goodput.json
    python -m benchmarks.goodput --recovery restart               # ours' recovery (default: auto)
    python -m benchmarks.goodput_score benchmarks/results/goodput.json   # rescore, no run
    python -m benchmarks.goodput_long --faults 1000               # the exactly-once soak

**Goodput** = useful steps x fault-free step time / wall time, over the window
from the first completed step at world size 3 to ``--minutes`` later.

- *Useful steps* are the audit's committed steps (``elastic_train.audit.committed_steps``):
  the chain of steps that produced the final state, so a step redone after a
  restore counts once and the steps a restore threw away count not at all. A
  step counts when every rank of its world recorded it, at the last record.
- *Fault-free step time* is a mean step time (1 / steps/s) of the same
  competitor with the same settings (checkpoint cadence included), so the
  steady costs every run pays (checkpoints, snapshots, audit records) cancel
  and what is left is what the faults cost: detection, re-rendezvous, restarts
  and redone steps. ``benchmarks.goodput_score`` takes it from the soak's own
  quiet segments (the headline: the same minutes, so load from other
  processes cancels) and, beside it, from separate fault-free runs at 3 and 2
  nodes (``--fault-free-worlds``, ``--fault-free-minutes`` long, run back to
  back with the soaks in the same repetition). Both scripts are world-size
  invariant (global batch 64 split over the ranks), so a step at world size 2
  is the same work as at 3; where 2 workers step *faster* than 3 (fewer cores
  than workers), the faster world's rate is the denominator, so a dead node's
  absence is never counted as a gain.

The events are the same node indices at the same offsets for every competitor;
a kill is SIGKILL of the node's agent and workers, a join restarts that node.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from benchmarks import goodput_score, harness
from benchmarks.cluster import BenchCluster
from benchmarks.harness import Competitor
from benchmarks.workloads import Workload
from elastic_train.audit import AuditLog, committed_steps
from elastic_train.config.job import ElasticConfig
from elastic_train.errors import ClusterError
from elastic_train.local.chaos import ChaosEvent, recovery_after
from elastic_train.log import get_logger

log = get_logger(__name__)

NODES = goodput_score.NODES
#: seconds between two looks at the agents while the soak waits for its next event
TICK_S = 0.2
#: the width of the bins useful steps are counted in, for the plot over time
BIN_S = 1.0
RecoveryMode = Literal["auto", "inprocess", "restart"]


@dataclass(frozen=True)
class SoakEvent:
    """A kill or (re)join of ``node``, ``at_seconds`` after the window opened."""

    kind: Literal["kill", "join"]
    node: int
    at_seconds: float


def soak_schedule(
    *, seconds: float, every: float, seed: int, nodes: int = NODES
) -> tuple[SoakEvent, ...]:
    """Kill a random node, rejoin it ``every`` s later, alternating, until the window ends."""
    rng = random.Random(seed)
    events: list[SoakEvent] = []
    victim: int | None = None
    at = every
    while at < seconds:
        if victim is None:
            victim = rng.randrange(nodes)
            events.append(SoakEvent("kill", victim, at))
        else:
            events.append(SoakEvent("join", victim, at))
            victim = None
        at += every
    return tuple(events)


@dataclass(frozen=True)
class Variant:
    """One competitor, with or without the fault schedule."""

    competitor: Competitor
    faults: bool
    nodes: int = NODES

    @property
    def name(self) -> str:
        if self.faults:
            return self.competitor.name
        suffix = "" if self.nodes == NODES else f"-{self.nodes}"
        return f"{self.competitor.name}-fault-free{suffix}"

    def unavailable(self) -> str | None:
        return self.competitor.unavailable()


def recovery_overrides(mode: RecoveryMode) -> tuple[tuple[str, ...], str]:
    """Our overrides for ``--recovery``, and what was actually run: the mode, or the
    restart path with a note when this build (an older commit being compared) has
    no ``elastic.recovery`` key."""
    if "recovery" in {f.name for f in dataclasses.fields(ElasticConfig)}:
        return (f"--elastic.recovery={mode}",), mode
    if mode != "restart":
        log.warning("goodput_recovery_ignored", requested=mode, reason="no elastic.recovery key")
        return (), f"restart ({mode} requested; this build has no elastic.recovery key)"
    return (), "restart (the only path in this build)"


def measure_soak(
    variant: Variant,
    workdir: Path,
    *,
    events: tuple[SoakEvent, ...],
    seconds: float,
    workload: Workload,
    startup_timeout: float = 300.0,
) -> dict[str, Any]:
    """One window of ``seconds``: the events (if ``variant.faults``) and the audit of it."""
    # A fault-free run is a fixed world: a wider --nnodes would keep its round open.
    spec = {
        "nodes": variant.nodes,
        "min_nodes": min(variant.nodes, NODES - 1),
        "max_nodes": NODES if variant.faults else variant.nodes,
    }
    with BenchCluster(variant.competitor, workload, workdir, **spec) as cluster:
        cluster.wait_step(1, world_size=variant.nodes, timeout=startup_timeout)
        opened = _first_step_time(cluster.tail.log)
        deliveries = drive(cluster, events if variant.faults else (), opened=opened)
        idle_until(cluster, opened + seconds)
    return audit_window(AuditLog.load(workdir / "audit"), deliveries, seconds=seconds)


def audit_window(
    audit: AuditLog, deliveries: list[dict[str, Any]], *, seconds: float
) -> dict[str, Any]:
    """Useful steps (per bin), recorded steps and each event's recovery in the window
    that opens at the first completed step."""
    opened = _first_step_time(audit)
    commits = commit_times(audit)
    closes = opened + seconds
    useful = [t - opened for t in commits if opened < t <= closes]
    recorded = {(r.attempt, r.step) for r in audit.steps if opened < r.time <= closes}
    bins = [0] * max(1, round(seconds / BIN_S))
    for t in useful:
        bins[min(len(bins) - 1, int(t // BIN_S))] += 1
    audited = [_with_recovery(audit, d) for d in deliveries]
    return {
        "useful_steps": len(useful),
        "useful_steps_per_second": len(useful) / seconds,
        "recorded_steps": len(recorded),
        "window_seconds": seconds,
        "bin_seconds": BIN_S,
        "steps_per_bin": bins,
        "kills": sum(d["kind"] == "kill" and bool(d.get("in_world")) for d in audited),
        "events": audited,
        **_event_medians(audited),
    }


def _first_step_time(log_: AuditLog) -> float:
    first = next(a for a in log_.attempts() if a.first_step_time is not None)
    assert first.first_step_time is not None
    return first.first_step_time


def drive(cluster: BenchCluster, events: tuple[SoakEvent, ...], *, opened: float) -> list[dict]:
    """Deliver each event at its offset from ``opened``; what happened to each."""
    out = []
    for event in events:
        idle_until(cluster, opened + event.at_seconds)
        chaos = ChaosEvent(kind=event.kind, node=event.node, at_seconds=0.0)
        moment, outcome = time.time(), cluster.local.deliver(chaos)
        deadline = moment + 30.0
        while outcome is None and time.time() < deadline:  # a join of a node still exiting
            idle_until(cluster, time.time() + TICK_S)
            outcome = cluster.local.deliver(chaos)
        out.append({**dataclasses.asdict(event), "time": moment, "outcome": str(outcome)})
        log.info("goodput_event", kind=event.kind, node=event.node, outcome=outcome)
    return out


def idle_until(cluster: BenchCluster, deadline: float) -> None:
    """Let the job run until wall time ``deadline``, reaping exited agents.

    The audit is read once at the end, not while the job runs: the driver takes
    no CPU from the workers of either competitor. A job whose agents all exited
    simply makes no more useful steps.
    """
    while (left := deadline - time.time()) > 0:
        cluster.local.poll()
        time.sleep(min(TICK_S, left))


def commit_times(audit: AuditLog) -> list[float]:
    """When each committed step was complete: its last rank's record, for full steps only."""
    try:
        committed = committed_steps(audit)
    except Exception as exc:  # the audit's own failure type is private to it
        raise ClusterError(f"the soak's audit has no committed chain: {exc}") from exc
    return sorted(
        max(r.time for r in records)
        for records in committed.values()
        if len({r.rank for r in records}) == records[0].world_size
    )


def _with_recovery(audit: AuditLog, delivery: dict[str, Any]) -> dict[str, Any]:
    """The event with the audited recovery after it, and whether a kill hit a node
    that was training (a rejoining node still starting up was not)."""
    if delivery["outcome"] != "delivered":
        return delivery
    rec = recovery_after(
        audit, kind=delivery["kind"], node=delivery["node"], event_time=delivery["time"]
    )
    before = [a for a in audit.attempts() if a.steps and a.start_time < delivery["time"]]
    nodes = {r.node for records in before[-1].steps.values() for r in records} if before else ()
    return {**delivery, "seconds": rec.seconds, "lost_steps": rec.lost_steps,
            "world_size_after": rec.world_size_after,
            "in_world": f"node{delivery['node']}" in nodes}  # fmt: skip


def _event_medians(audited: list[dict[str, Any]]) -> dict[str, Any]:
    """Median seconds to the first step after a kill of a training node and after a
    join, and the most steps a kill lost."""
    out: dict[str, Any] = {}
    for kind in ("kill", "join"):
        recs = [d for d in audited if d["kind"] == kind and (kind == "join" or d.get("in_world"))]
        out[f"{kind}_seconds"] = harness.summarize([r.get("seconds") for r in recs])["median"]
        lost = [r["lost_steps"] for r in recs if r.get("lost_steps") is not None]
        out[f"{kind}_max_lost_steps"] = max(lost, default=None)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.base_parser(__doc__.splitlines()[0], default_repeats=1)
    p.set_defaults(competitors="ours,c10d-tuned")
    p.add_argument("--minutes", type=float, default=10.0, help="length of each window")
    p.add_argument("--every", type=float, default=30.0, help="seconds between two events")
    p.add_argument("--seed", type=int, default=0, help="seeds the choice of the node killed")
    p.add_argument("--fault-free-minutes", type=float, default=None, help="default: --minutes")
    p.add_argument(
        "--fault-free-worlds",
        default="3,2",
        help="node counts of the fault-free runs; the fastest is the denominator",
    )
    p.add_argument(
        "--pace-ms",
        type=float,
        default=0.0,
        help="a sleep per forward in both scripts (benchmarks.workloads' step_seconds)",
    )
    harness.add_recovery_argument(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.smoke:
        args.minutes, args.every, args.fault_free_worlds = 0.15, 3.0, "3"
        # The fault-free window only has to hold steady steps: 6 s, not the soak's 9.
        args.fault_free_minutes = args.fault_free_minutes or 0.1
    seconds = args.minutes * 60.0
    free_seconds = 60.0 * (args.fault_free_minutes or args.minutes)
    worlds = [int(w) for w in args.fault_free_worlds.split(",")]
    events = soak_schedule(seconds=seconds, every=args.every, seed=args.seed)
    overrides, recovery_run = recovery_overrides(args.recovery)
    competitors = harness.select_competitors(args.competitors, args.rdzv_conf)
    variants = [Variant(c, faults=False, nodes=n) for n in worlds for c in competitors]
    variants += [Variant(c, faults=True) for c in competitors]
    workload = Workload(ours_overrides=overrides, step_seconds=args.pace_ms / 1000.0)
    started, host = time.time(), harness.machine()
    tmp = harness.scratch(args.workdir)
    workdir = Path(tmp.name) if tmp else args.workdir
    try:
        outcomes = harness.run_interleaved(
            variants,
            repeats=args.repeats,
            workdir=workdir,
            measure=lambda v, d: measure_soak(
                v,
                d,
                events=events,
                seconds=seconds if v.faults else free_seconds,
                workload=workload,
            ),
        )
    finally:
        if tmp:
            tmp.cleanup()
    payload = {
        "benchmark": "goodput",
        "started": started,
        "finished": time.time(),
        "machine": host,
        "repeats": args.repeats,
        "settings": {
            "minutes": args.minutes,
            "fault_free_minutes": free_seconds / 60.0,
            "fault_free_worlds": worlds,
            "every_seconds": args.every,
            "seed": args.seed,
            "nodes": NODES,
            "recovery_requested": args.recovery,
            "pace_ms": args.pace_ms,
            "recovery_run": recovery_run,
            "schedule": [dataclasses.asdict(e) for e in events],
            "denominator": "the soak's own quiet segments (the last third of each "
            "interval between events), the faster world size's steps/s",
        },
        "rdzv_conf": {c.name: c.rdzv_conf for c in competitors},
        "headline_metric": "goodput",
        "reference": "ours",
        "runs": {n: dataclasses.asdict(o) for n, o in outcomes.items()},
    }
    goodput_score.score(payload)
    name = "goodput_smoke" if args.smoke else "goodput"
    harness.write_results(name, payload, out_dir=args.out_dir)
    return payload


if __name__ == "__main__":
    main()
