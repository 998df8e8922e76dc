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
from benchmarks.events import event_main

TARGET_MEDIAN_SECONDS = 5.0


def targets(summary: dict[str, dict[str, Any]]) -> list[harness.Target]:
    median = harness.median_of(summary, "ours", "seconds")
    return [harness.Target("ours median scale-up, s", median, TARGET_MEDIAN_SECONDS)]


def main(argv: list[str] | None = None) -> None:
    event_main(
        argv,
        name="scaleup",
        description=__doc__.splitlines()[0],
        kind="join",
        world_delta=1,
        full={"nodes": 3, "warmup_steps": 60, "timeout": 75.0},
        smoke={"nodes": 1, "warmup_steps": 5, "timeout": 60.0},
        targets=targets,
    )


if __name__ == "__main__":
    main()
