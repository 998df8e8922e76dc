"""Recovery after losing a node: three nodes train, one node's agent and
workers are SIGKILLed, and we time kill -> first completed step at world size 2.

Recovery seconds, lost steps and the breakdown (failure noticed, dead node
pruned, round closed, workers spawned, checkpoint restored, first step) are
measured as ``benchmarks.events`` describes.

    python -m benchmarks.recovery --repeats 5
    python -m benchmarks.recovery --repeats 5 --target rank0     # results/recovery_rank0.json
    python -m benchmarks.recovery --repeats 5 --target nonzero   # results/recovery_nonzero.json
    python -m benchmarks.recovery --repeats 5 --recovery restart  # recovery_restart.json

``--target`` picks the node killed: the last one started (default), the one
running global rank 0 (the rendezvous and the checkpoint writer of the plain
script live there), or one running another rank. ``--recovery`` sets ours'
``elastic.recovery``: by default ``auto``, the product's default (in process:
the survivors keep their processes); ``restart`` or ``inprocess`` name the
file after the mode. The competitors run as always, so the file holds both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.events import EVENT_METRICS, Target, measure_event
from benchmarks.harness import Competitor
from benchmarks.workloads import Workload

METRICS = EVENT_METRICS
TARGET_MEDIAN_SECONDS = 4.0
STRETCH_MEDIAN_SECONDS = 3.0
#: Issue #20: failure to the next step without restarting the survivors.
INPROCESS_MEDIAN_SECONDS = 0.5


def measure(
    comp: Competitor,
    workdir: Path,
    *,
    nodes: int = 3,
    warmup_steps: int = 60,
    timeout: float = 150.0,
    target: Target = "last",
    recovery: str = "auto",
) -> dict[str, Any]:
    return measure_event(
        comp,
        workdir,
        kind="kill",
        target=target,
        nodes=nodes,
        world_after=nodes - 1,
        warmup_steps=warmup_steps,
        timeout=timeout,
        workload=Workload(ours_overrides=(f"--elastic.recovery={recovery}",)),
    )


def targets(summary: dict[str, dict[str, Any]], *, recovery_mode: str) -> list[harness.Target]:
    """The targets; ``recovery_mode``: ours' ``--recovery`` (the restart path has
    no in-process target)."""
    recovery = harness.median_of(summary, "ours", "seconds")
    lost = summary.get("ours", {}).get("lost_steps", {}).get("max")
    tuned = [
        harness.median_of(summary, name, "seconds") for name in ("c10d-tuned", "etcd-v2-tuned")
    ]
    best_tuned = min((t for t in tuned if t is not None), default=None)
    in_process = []
    if recovery_mode != "restart":
        in_process = [harness.Target("ours median recovery, in process (#20), s", recovery,
                                     INPROCESS_MEDIAN_SECONDS)]  # fmt: skip
    return [
        *in_process,
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
    parser.add_argument("--target", choices=("last", "rank0", "nonzero"), default="last")
    harness.add_recovery_argument(parser)
    args = parser.parse_args(argv)
    competitors = harness.select_competitors(args.competitors, args.rdzv_conf)
    kwargs: dict[str, Any] = {"nodes": 3, "warmup_steps": 60}
    if args.smoke:
        kwargs = {"nodes": 2, "warmup_steps": 5, "timeout": 60.0}
    kwargs["target"], kwargs["recovery"] = args.target, args.recovery
    name = "recovery" if args.target == "last" else f"recovery_{args.target}"
    if args.recovery != "auto":
        name += f"_{args.recovery}"
    harness.run_benchmark(
        f"{name}_smoke" if args.smoke else name,
        args,
        competitors,
        measure=lambda c, d: measure(c, d, **kwargs),
        metrics=METRICS,
        headline="seconds",
        targets=lambda summary: targets(summary, recovery_mode=args.recovery),
        settings=kwargs,
    )


if __name__ == "__main__":
    main()
