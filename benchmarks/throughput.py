"""Steady-state throughput: two nodes, no faults, the same model, data and
global batch for elastic_train (at its defaults: metrics, logging, async
checkpoints every 25 steps and its per-step snapshot) and the plain DDP script
(rank-0 ``torch.save`` every 25 steps). Samples per second over a window of
steps after a warm-up, from the audit records' times (the last rank's record
of each step), so both are timed identically.

    python -m benchmarks.throughput --repeats 5
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.cluster import BenchCluster
from benchmarks.harness import Competitor
from benchmarks.workloads import Workload

METRICS = ("samples_per_second", "steps_per_second")
TARGET_RATIO = 0.99


def measure(
    comp: Competitor, workdir: Path, *, warmup_steps: int, window_steps: int, timeout: float
) -> dict[str, Any]:
    workload = Workload(steps=warmup_steps + window_steps)
    spec = {"nodes": 2, "min_nodes": 2, "max_nodes": 2}
    with BenchCluster(comp, workload, workdir, **spec) as cluster:
        last = warmup_steps + window_steps
        cluster.wait_step(last, world_size=2, timeout=timeout)
        steps = cluster.steps(world_size=2)
    attempts = {r.attempt for r in steps}
    if len(attempts) != 1:
        raise RuntimeError(f"a fault-free run restarted: {len(attempts)} attempts")
    done = {s: max(r.time for r in steps if r.step == s) for s in (warmup_steps, last)}
    seconds = done[last] - done[warmup_steps]
    return {
        "samples_per_second": window_steps * workload.global_batch_size / seconds,
        "steps_per_second": window_steps / seconds,
        "window_seconds": seconds,
    }


def targets(summary: dict[str, dict[str, Any]]) -> list[harness.Target]:
    ours = harness.median_of(summary, "ours", "samples_per_second")
    plain = [
        harness.median_of(summary, name, "samples_per_second") for name in summary if name != "ours"
    ]
    plain_median = next((p for p in plain if p is not None), None)
    value = harness.ratio(ours, plain_median)
    return [harness.Target("ours / plain DDP samples/s", value, TARGET_RATIO, kind="min")]


def main(argv: list[str] | None = None) -> None:
    parser = harness.base_parser(__doc__.splitlines()[0], default_repeats=5)
    parser.set_defaults(competitors="ours,c10d-default")
    args = parser.parse_args(argv)
    kwargs: dict[str, Any] = {"warmup_steps": 50, "window_steps": 400, "timeout": 300.0}
    if args.smoke:
        kwargs = {"warmup_steps": 5, "window_steps": 30, "timeout": 60.0}
    harness.run_benchmark(
        "throughput_smoke" if args.smoke else "throughput",
        args,
        harness.select_competitors(args.competitors),
        measure=lambda c, d: measure(c, d, **kwargs),
        metrics=METRICS,
        headline="samples_per_second",
        targets=targets,
        settings=kwargs,
    )


if __name__ == "__main__":
    main()
