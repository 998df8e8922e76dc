"""Graceful preemption: three nodes train, one node's agent gets SIGTERM (as
Kubernetes sends it to a pod's PID 1; torchrun passes it on to its workers),
and we count the steps lost and time SIGTERM -> first completed step at world
size 2 (measured as ``benchmarks.events`` describes).

    python -m benchmarks.preemption --repeats 5
"""

from __future__ import annotations

from typing import Any

from benchmarks import harness
from benchmarks.events import event_main


def targets(summary: dict[str, dict[str, Any]]) -> list[harness.Target]:
    lost = summary.get("ours", {}).get("lost_steps", {}).get("max")
    return [harness.Target("ours max lost steps on SIGTERM", lost, 0)]


def main(argv: list[str] | None = None) -> None:
    event_main(
        argv,
        name="preemption",
        description=__doc__.splitlines()[0],
        kind="term",
        world_delta=-1,
        full={"nodes": 3, "warmup_steps": 60, "timeout": 150.0},
        smoke={"nodes": 2, "warmup_steps": 5, "timeout": 60.0},
        targets=targets,
    )


if __name__ == "__main__":
    main()
