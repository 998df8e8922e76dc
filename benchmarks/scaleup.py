"""Scale-up: three nodes train, a fourth node's agent starts, and we time
agent start -> first completed step at world size 4 (measured as
``benchmarks.events`` describes; torch 2.13's shared TCPStore can hang a
joiner here, which the tuned torch competitors avoid with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).

    python -m benchmarks.scaleup --repeats 5
"""

from __future__ import annotations

from typing import Any

from benchmarks import harness
from benchmarks.events import EVENT_METRICS, measure_event

TARGET_MEDIAN_SECONDS = 5.0


def targets(summary: dict[str, dict[str, Any]]) -> list[harness.Target]:
    median = harness.median_of(summary, "ours", "seconds")
    return [harness.Target("ours median scale-up, s", median, TARGET_MEDIAN_SECONDS)]


def main(argv: list[str] | None = None) -> None:
    parser = harness.base_parser(__doc__.splitlines()[0], default_repeats=5)
    args = parser.parse_args(argv)
    kwargs: dict[str, Any] = {"nodes": 3, "warmup_steps": 60, "timeout": 75.0}
    if args.smoke:
        kwargs = {"nodes": 1, "warmup_steps": 5, "timeout": 60.0}
    harness.run_benchmark(
        "scaleup_smoke" if args.smoke else "scaleup",
        args,
        harness.select_competitors(args.competitors),
        measure=lambda c, d: measure_event(
            c, d, kind="join", world_after=kwargs["nodes"] + 1, **kwargs
        ),
        metrics=EVENT_METRICS,
        headline="seconds",
        targets=targets,
        settings=kwargs,
    )


if __name__ == "__main__":
    main()
