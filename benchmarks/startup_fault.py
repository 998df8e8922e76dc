"""A node lost before its first process group: three nodes start, and one node's
agent and workers are SIGKILLed as soon as its worker exists, before the group
forms; we time kill -> first completed step at world size 2.

No survivor's collective fails then (there is no group yet): the survivors'
workers wait for the dead node's at their store, unless something tells their
agents it died (ours: the round settles, docs/rendezvous.md rule 2).

    python -m benchmarks.startup_fault --repeats 3
"""

from __future__ import annotations

import time
from typing import Any

import psutil

from benchmarks import harness
from benchmarks.cluster import BenchCluster
from benchmarks.events import STAGES, breakdown
from benchmarks.harness import Competitor
from benchmarks.workloads import Workload
from elastic_train.agent.zygote import trainer_processes
from elastic_train.errors import ClusterError

METRICS = ("seconds", *(f"{key}_seconds" for key, _ in STAGES))
#: the seconds the survivors would wait at the store (ours' pg_timeout_seconds)
STORE_TIMEOUT_S = 60.0


def measure(comp: Competitor, workdir: Any, *, nodes: int = 3, timeout: float = 150.0) -> dict:
    """One start of ``nodes`` nodes with the last one killed as its worker starts."""
    victim = nodes - 1
    spec = {"nodes": nodes, "min_nodes": nodes - 1, "max_nodes": nodes}
    with BenchCluster(comp, Workload(), workdir, **spec) as cluster:
        _await_worker(cluster, victim, timeout=timeout)
        moment = cluster.deliver("kill", victim)
        rec = cluster.wait_recovery(
            kind="kill", node=victim, event_time=moment, world_size=nodes - 1, timeout=timeout
        )
        log = cluster.tail.log
        others = [f"node{i}" for i in range(nodes) if i != victim]
        return {
            **rec.to_json(),
            # A worker that lost the store's host (the agent of group rank 0) fails at
            # once (peer_error, failure_noticed); otherwise a prune ends the round.
            **breakdown(cluster, moment, others),
            # Either makes the run another fault than this one: say so in the record.
            "group_formed_before_kill": any(
                r.world_size == nodes and r.time < moment for r in log.steps
            ),
            "first_round_short": any(
                a.world_size < nodes and a.start_time < moment for a in log.attempts()
            ),
        }


def _await_worker(cluster: BenchCluster, node: int, *, timeout: float) -> None:
    """Until the agent of ``node`` has a worker (it starts its workers after the round)."""
    (agent,) = [psutil.Process(n.proc.pid) for n in cluster.local.alive_nodes()
                if n.name == f"node{node}"]  # fmt: skip
    deadline = time.monotonic() + timeout
    while not trainer_processes(agent):
        if time.monotonic() > deadline:
            raise ClusterError(f"node{node} started no worker within {timeout:.0f}s")
        time.sleep(0.01)


def targets(summary: dict[str, dict[str, Any]]) -> list[harness.Target]:
    seconds = summary.get("ours", {}).get("seconds", {}).get("median")
    return [harness.Target("ours median kill -> first step, s", seconds, STORE_TIMEOUT_S / 4)]


def main(argv: list[str] | None = None) -> None:
    args = harness.base_parser(__doc__.splitlines()[0], default_repeats=3).parse_args(argv)
    settings = {"nodes": 2, "timeout": 60.0} if args.smoke else {"nodes": 3, "timeout": 150.0}
    harness.run_benchmark(
        "startup_fault_smoke" if args.smoke else "startup_fault",
        args,
        harness.select_competitors(args.competitors, args.rdzv_conf),
        measure=lambda c, d: measure(c, d, **settings),
        metrics=METRICS,
        headline="seconds",
        targets=targets,
        settings=settings,
    )


if __name__ == "__main__":
    main()
