"""Recovery after losing a node: three nodes train, one node's agent and
workers are SIGKILLed, and we time kill -> first completed step at world size 2.

Breakdown (seconds after the kill, from the survivors' agent log lines and
the audit records): a survivor's worker saw the peer error; failure noticed
(an agent saw its worker group fail); dead node pruned (only where the backend
logs it above DEBUG: torch's dynamic rendezvous logs it at DEBUG on a logger
torchrun leaves at INFO, so it is null for the torch backends); round closed
(an agent's "Rendezvous complete"); workers spawned ("Starting worker group");
checkpoint restored (the workers' ``resume`` record); first step.

Recovery seconds and lost steps are audited exactly as the local runner's
summary does (``elastic_train.chaos.recovery_after``): kill -> the last rank's
record of the first step of the first attempt started after the kill; lost =
the highest step completed before the kill minus the step that attempt
restored.

    python -m benchmarks.recovery --repeats 5
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.cluster import BenchCluster
from benchmarks.harness import Competitor
from benchmarks.workloads import Workload
from elastic_train.chaos import Recovery

#: (breakdown key, regex over the survivors' agent output).
STAGES = (
    ("peer_error", r"Connection (reset|closed) by peer"),
    ("failure_noticed", r"Worker group (FAILED|UNHEALTHY)|attempts to join the next round"),
    ("dead_node_pruned", r"Detected dead node|dead_node_pruned|node_pruned"),
    ("round_closed", r"Rendezvous complete for workers"),
    ("workers_spawned", r"Starting worker group"),
)
METRICS = (
    "recovery_seconds",
    "lost_steps",
    *(f"{key}_seconds" for key, _ in STAGES),
    "restored_seconds",
)
TARGET_MEDIAN_SECONDS = 4.0
STRETCH_MEDIAN_SECONDS = 3.0


def measure(
    comp: Competitor,
    workdir: Path,
    *,
    nodes: int = 3,
    warmup_steps: int = 60,
    timeout: float = 150.0,
    workload: Workload | None = None,
) -> dict[str, Any]:
    spec = {"nodes": nodes, "min_nodes": nodes - 1, "max_nodes": nodes}
    with BenchCluster(comp, workload or Workload(), workdir, **spec) as cluster:
        cluster.wait_step(warmup_steps, world_size=nodes, timeout=timeout)
        victim = nodes - 1
        killed = cluster.deliver("kill", victim)
        rec = cluster.wait_recovery(
            kind="kill", node=victim, event_time=killed, world_size=nodes - 1, timeout=timeout
        )
        survivors = [f"node{i}" for i in range(nodes - 1)]
        return {**recovery_json(rec), **breakdown(cluster, killed, survivors)}


def recovery_json(rec: Recovery) -> dict[str, Any]:
    out = rec.to_json()
    out["recovery_seconds"] = out.pop("seconds")
    return out


def breakdown(cluster: BenchCluster, event_time: float, nodes: list[str]) -> dict[str, Any]:
    """Seconds from the event to each stage (None when a stage left no trace)."""
    out: dict[str, Any] = {}
    for key, pattern in STAGES:
        stamp = cluster.logs.first(pattern, after=event_time, nodes=nodes)
        out[f"{key}_seconds"] = None if stamp is None else stamp - event_time
    resumes = [r.time for r in cluster.tail.log.resumes if r.time >= event_time]
    out["restored_seconds"] = min(resumes) - event_time if resumes else None
    return out


def targets(summary: dict[str, dict[str, Any]]) -> list[harness.Target]:
    recovery = harness.median_of(summary, "ours", "recovery_seconds")
    lost = summary.get("ours", {}).get("lost_steps", {}).get("max")
    tuned = [
        harness.median_of(summary, name, "recovery_seconds")
        for name in ("c10d-tuned", "etcd-v2-tuned")
    ]
    best_tuned = min((t for t in tuned if t is not None), default=None)
    return [
        harness.Target("ours median recovery, s", recovery, TARGET_MEDIAN_SECONDS),
        harness.Target("ours median recovery (stretch), s", recovery, STRETCH_MEDIAN_SECONDS),
        harness.Target(
            "ours median / best tuned competitor median",
            harness.ratio(recovery, best_tuned),
            1.0,
        ),
        harness.Target("ours max lost steps per failure", lost, 1),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = harness.base_parser(__doc__.splitlines()[0], default_repeats=5)
    args = parser.parse_args(argv)
    competitors = harness.select_competitors(args.competitors)
    kwargs: dict[str, Any] = {"nodes": 3, "warmup_steps": 60}
    if args.smoke:
        kwargs = {"nodes": 2, "warmup_steps": 5, "timeout": 60.0}
    harness.run_benchmark(
        "recovery_smoke" if args.smoke else "recovery",
        args,
        competitors,
        measure=lambda c, d: measure(c, d, **kwargs),
        metrics=METRICS,
        headline="recovery_seconds",
        targets=targets,
        settings=kwargs,
    )


if __name__ == "__main__":
    main()
