"""One fault or join against a running cluster, audited the way the local
runner audits it (``elastic_train.local.chaos.recovery_after``): event -> the last
rank's record of the first step of the first attempt that started after it;
lost steps = the highest step recorded before the event (a rank records a
step as its gradient all-reduce starts, so the step a failure broke counts)
minus the step that attempt restored.

The breakdown (seconds after the event) comes from the agents' log lines,
stamped as they reach the log, and the workers' ``resume`` records:

- ``peer_error``: a worker saw its peer's connection drop;
- ``failure_noticed``: an agent saw its worker group fail, or joined a new round;
- ``dead_node_pruned``: only where the backend logs it above DEBUG (torch's
  dynamic rendezvous logs it at DEBUG on a logger torchrun leaves at INFO, so
  it is null for the torch backends and ours, which uses torch's handler);
- ``round_closed``: an agent's "Rendezvous complete";
- ``workers_spawned``: "Starting worker group";
- ``restored``: the first ``resume`` record (checkpoint or snapshot loaded).

``stall_seconds`` is what the survivors felt: from the last step record before
the recovering attempt started to its first step. For a join it leaves out the
joiner's own start-up, during which the others train on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from benchmarks import harness
from benchmarks.cluster import BenchCluster
from benchmarks.harness import Competitor
from benchmarks.workloads import Workload
from elastic_train.errors import ClusterError
from elastic_train.local.chaos import ChaosKind, node_of_rank

#: (breakdown key, regex over the agents' output).
STAGES = (
    ("peer_error", r"Connection (reset|closed) by peer"),
    ("failure_noticed", r"Worker group (FAILED|UNHEALTHY)|attempts to join the next round"),
    ("dead_node_pruned", r"Detected dead node|dead_node_pruned|nodes?_pruned"),
    ("round_closed", r"Rendezvous complete for workers"),
    ("workers_spawned", r"Starting worker group"),
)
EVENT_METRICS = (
    "seconds",
    "lost_steps",
    *(f"{key}_seconds" for key, _ in STAGES),
    "restored_seconds",
    "stall_seconds",
)
#: Which node a kill or term hits: the last one started, the one running global
#: rank 0, or one running another rank (resolved from the audit when it is due).
Target = Literal["last", "rank0", "nonzero"]


def measure_event(
    comp: Competitor,
    workdir: Path,
    *,
    kind: ChaosKind,
    nodes: int,
    world_after: int,
    warmup_steps: int,
    timeout: float,
    workload: Workload | None = None,
    target: Target = "last",
    settle_steps: int = 0,
) -> dict[str, Any]:
    """Start ``nodes`` nodes, train ``warmup_steps``, deliver ``kind`` and time the recovery.

    A kill or term hits the node ``target`` names; a join starts node ``nodes``.
    ``settle_steps``: steps more at the new world size before the cluster stops
    (for a caller that reads the step times after the event from ``workdir``).
    """
    spec = {
        "nodes": nodes,
        "min_nodes": min(nodes, world_after),
        "max_nodes": max(nodes, world_after),
    }
    with BenchCluster(comp, workload or Workload(), workdir, **spec) as cluster:
        cluster.wait_step(warmup_steps, world_size=nodes, timeout=timeout)
        node = nodes if kind == "join" else victim(cluster, target, nodes=nodes)
        moment = cluster.deliver(kind, node)
        rec = cluster.wait_recovery(
            kind=kind, node=node, event_time=moment, world_size=world_after, timeout=timeout
        )
        if settle_steps:
            reached = cluster.highest_step.get(world_after, 0)
            cluster.wait_step(reached + settle_steps, world_size=world_after, timeout=timeout)
        others = [f"node{i}" for i in range(max(nodes, node + 1)) if i != node or kind == "join"]
        return {**rec.to_json(), "target": target, **breakdown(cluster, moment, others)}


def victim(cluster: BenchCluster, target: Target, *, nodes: int) -> int:
    """The node index ``target`` names now (ranks from the workers' latest records)."""
    if target == "last":
        return nodes - 1
    rank = 0 if target == "rank0" else nodes - 1
    node = node_of_rank(cluster.tail.log, rank)
    if node is None:
        raise ClusterError(f"no worker has recorded rank {rank} yet")
    return node


def breakdown(cluster: BenchCluster, event_time: float, nodes: list[str]) -> dict[str, Any]:
    """Seconds from the event to each stage (None when a stage left no trace)."""
    out: dict[str, Any] = {}
    for key, pattern in STAGES:
        stamp = cluster.logs.first(pattern, after=event_time, nodes=nodes)
        out[f"{key}_seconds"] = None if stamp is None else stamp - event_time
    resumes = [r.time for r in cluster.tail.log.resumes if r.time >= event_time]
    out["restored_seconds"] = min(resumes) - event_time if resumes else None
    out["stall_seconds"] = stall(cluster, event_time)
    return out


def stall(cluster: BenchCluster, event_time: float) -> float | None:
    """Last step recorded before the recovering attempt started -> its first step."""
    log = cluster.tail.log
    attempt = next((a for a in log.attempts(started_after=event_time) if a.first_step_time), None)
    if attempt is None or attempt.first_step_time is None:
        return None
    before = [r.time for r in log.steps if r.time < attempt.start_time]
    return attempt.first_step_time - max(before) if before else None


def event_main(
    argv: list[str] | None,
    *,
    name: str,
    description: str,
    kind: ChaosKind,
    world_delta: int,
    full: dict[str, Any],
    smoke: dict[str, Any],
    targets: Callable[[dict[str, dict[str, Any]]], list[harness.Target]],
) -> None:
    """The command line of a one-event benchmark; the world size after the event
    is ``nodes + world_delta``."""
    args = harness.base_parser(description, default_repeats=5).parse_args(argv)
    kwargs = smoke if args.smoke else full
    harness.run_benchmark(
        f"{name}_smoke" if args.smoke else name,
        args,
        harness.select_competitors(args.competitors, args.rdzv_conf),
        measure=lambda c, d: measure_event(
            c, d, kind=kind, world_after=kwargs["nodes"] + world_delta, **kwargs
        ),
        metrics=EVENT_METRICS,
        headline="seconds",
        targets=targets,
        settings=kwargs,
    )
