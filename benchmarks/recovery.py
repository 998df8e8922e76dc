"""Recovery after losing a node: three nodes train, one node's agent and
workers are SIGKILLed, and we time kill -> first completed step at world size 2.

Breakdown (seconds after the kill, from the survivors' agent log lines and the
audit records): a survivor's worker saw the peer error, failure noticed (an agent saw its worker group fail), dead
node pruned (only where the backend logs it above DEBUG: torch's
dynamic rendezvous logs it at DEBUG on a logger torchrun leaves at INFO, so it
is null for the torch backends), round closed (an agent's
"Rendezvous complete"), workers spawned ("Starting worker group"), checkpoint
restored (the workers' ``resume`` record), first step.

Lost steps = the highest step completed before the restarted workers resumed
minus the step they restored.

    python -m benchmarks.recovery --repeats 5
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.cluster import BenchCluster, ClusterSpec
from benchmarks.harness import Competitor
from benchmarks.workloads import Workload

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
    spec = ClusterSpec(comp, workload or Workload(), min_nodes=nodes - 1, max_nodes=nodes)
    with BenchCluster(spec, workdir) as cluster:
        for i in range(nodes):
            cluster.add_node(f"node{i}")
        cluster.wait(
            f"step {warmup_steps} at world size {nodes}",
            lambda: any(r["step"] >= warmup_steps for r in cluster.audit.steps(world_size=nodes)),
            timeout=timeout,
        )
        victim = cluster.nodes[f"node{nodes - 1}"]
        killed = victim.signal_all(signal.SIGKILL)
        first = cluster.wait(
            f"first step at world size {nodes - 1}",
            cluster.first_step(after=killed, world_size=nodes - 1),
            timeout=timeout,
        )
        survivors = [n for n in cluster.nodes.values() if n is not victim]
        run: dict[str, Any] = {"recovery_seconds": first["time"] - killed}
        for key, pattern in STAGES:
            stamps = [n.first_line(pattern, after=killed) for n in survivors]
            seen = [s - killed for s in stamps if s is not None]
            run[f"{key}_seconds"] = min(seen) if seen else None
        resumes = cluster.audit.resumes(after=killed)
        restored = min(resumes, key=lambda r: r["time"]) if resumes else None
        run["restored_seconds"] = restored["time"] - killed if restored else None
        last_before = cluster.audit.last_step_before(restored["time"] if restored else killed)
        run["last_step_before_kill"] = last_before
        run["restored_step"] = restored["restored_step"] if restored else None
        run["restore_source"] = restored.get("source") if restored else None
        run["lost_steps"] = last_before - restored["restored_step"] if restored else None
        return run


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
