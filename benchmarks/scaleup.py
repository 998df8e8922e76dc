"""Scale-up: three nodes train, a fourth node's agent starts, and we time
agent start -> first completed step at world size 4, and the survivors' stall
(measured as ``benchmarks.events`` describes; torch 2.13's shared TCPStore can
hang a joiner here, which the tuned torch competitors avoid with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).

    python -m benchmarks.scaleup --repeats 5
    python -m benchmarks.scaleup --repeats 5 --recovery restart   # scaleup_restart.json

``--recovery`` sets ours' ``elastic.recovery``; by default ``auto``, the
product's default: in process, the fourth node's agent gets a side round and
its worker is admitted at a step boundary (an async join,
``training/admission.py``) while the survivors keep their processes.
``restart`` or ``inprocess`` name the file after the mode.
"""

from __future__ import annotations

from typing import Any

from benchmarks import harness
from benchmarks.events import EVENT_METRICS, measure_event
from benchmarks.workloads import Workload

TARGET_MEDIAN_SECONDS = 5.0
FULL: dict[str, Any] = {"nodes": 3, "warmup_steps": 60, "timeout": 75.0}
SMOKE: dict[str, Any] = {"nodes": 1, "warmup_steps": 5, "timeout": 60.0}


def targets(summary: dict[str, dict[str, Any]]) -> list[harness.Target]:
    median = harness.median_of(summary, "ours", "seconds")
    return [harness.Target("ours median scale-up, s", median, TARGET_MEDIAN_SECONDS)]


def main(argv: list[str] | None = None) -> None:
    parser = harness.base_parser(__doc__.splitlines()[0], default_repeats=5)
    harness.add_recovery_argument(parser)
    args = parser.parse_args(argv)
    kwargs = SMOKE if args.smoke else FULL
    name = "scaleup" if args.recovery == "auto" else f"scaleup_{args.recovery}"
    workload = Workload(ours_overrides=(f"--elastic.recovery={args.recovery}",))
    harness.run_benchmark(
        f"{name}_smoke" if args.smoke else name,
        args,
        harness.select_competitors(args.competitors, args.rdzv_conf),
        measure=lambda c, d: measure_event(
            c, d, kind="join", world_after=kwargs["nodes"] + 1, workload=workload, **kwargs
        ),
        metrics=EVENT_METRICS,
        headline="seconds",
        targets=targets,
        settings={**kwargs, "recovery": args.recovery},
    )


if __name__ == "__main__":
    main()
