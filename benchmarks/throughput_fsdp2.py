"""FSDP2 steady-state throughput: two nodes, no faults, the same model, data and
global batch for elastic_train with ``training.parallel = "fsdp2"`` (at its
defaults otherwise: metrics, logging, asynchronous DCP checkpoints every 25
steps; no snapshots under fsdp2) and the plain ``fully_shard`` script
(``competitors/plain_fsdp2.py``: ``dcp.save`` every 25 steps), launched like
the plain DDP pair's ``c10d-default``. Measured as ``benchmarks/throughput.py``
measures the DDP pair (audit record times over a window after a warm-up),
pairs run back to back.

    python -m benchmarks.throughput_fsdp2 --repeats 5
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.cluster import BenchCluster
from benchmarks.harness import Competitor
from benchmarks.throughput import METRICS, window_rates
from benchmarks.workloads import Workload

PLAIN_FSDP2 = Path(__file__).resolve().parent / "competitors" / "plain_fsdp2.py"
OURS = Competitor("ours-fsdp2", "etcd-v3", ours=True)
PLAIN = Competitor("plain-fsdp2", "c10d")
TARGET_RATIO = 0.99


def two_nodes(comp: Competitor, workdir: Path, *, steps: int) -> BenchCluster:
    """The fault-free 2-node run of ``comp``, not started."""
    workload = Workload(steps=steps, ours_overrides=("--training.parallel=fsdp2",))
    cluster = BenchCluster(comp, workload, workdir, nodes=2, min_nodes=2, max_nodes=2)
    if not comp.ours:  # the harness knows one plain script; this pair's is the FSDP2 one
        spec = cluster.local.spec
        cluster.local.spec = dataclasses.replace(spec, script=str(PLAIN_FSDP2))
    return cluster


def measure(
    comp: Competitor, workdir: Path, *, warmup_steps: int, window_steps: int, timeout: float
) -> dict[str, Any]:
    with two_nodes(comp, workdir, steps=warmup_steps + window_steps) as cluster:
        cluster.wait_step(warmup_steps + window_steps, world_size=2, timeout=timeout)
    return window_rates(cluster, warmup_steps=warmup_steps, window_steps=window_steps)


def targets(summary: dict[str, dict[str, Any]]) -> list[harness.Target]:
    """1 / the median over repetitions of plain / ours of the same repetition."""
    plain_per_ours = harness.median_of(summary, PLAIN.name, "paired_ratio")
    value = harness.ratio(1.0, plain_per_ours)
    return [
        harness.Target("ours-fsdp2 / plain fully_shard samples/s", value, TARGET_RATIO, kind="min")
    ]


def main(argv: list[str] | None = None) -> None:
    parser = harness.base_parser(__doc__.splitlines()[0], default_repeats=5)
    parser.set_defaults(competitors=f"{OURS.name},{PLAIN.name}")
    args = parser.parse_args(argv)
    kwargs: dict[str, Any] = {"warmup_steps": 100, "window_steps": 1000, "timeout": 300.0}
    if args.smoke:
        kwargs = {"warmup_steps": 5, "window_steps": 30, "timeout": 60.0}
    harness.run_benchmark(
        "throughput_fsdp2_smoke" if args.smoke else "throughput_fsdp2",
        args,
        [OURS, PLAIN],
        measure=lambda c, d: measure(c, d, **kwargs),
        metrics=METRICS,
        headline="samples_per_second",
        targets=targets,
        settings=kwargs,
        reference=OURS.name,
    )


if __name__ == "__main__":
    main()
