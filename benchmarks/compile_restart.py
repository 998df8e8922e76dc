"""Restart cost with and without ``training.compile``, with and without the warm
zygote: two nodes train, one node's agent and workers are SIGKILLed, and we time
kill -> first completed step at world size 1 (measured as ``benchmarks.events``
describes, as ``benchmarks.recovery`` does).

Every worker start compiles again: the restarted survivor traces the model and
loads the compiled kernels from inductor's on-disk cache, which the first start
of the same run filled (the warm-up steps pay the cold compile, unmeasured).

    python -m benchmarks.compile_restart --repeats 3
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.events import EVENT_METRICS, measure_event
from benchmarks.harness import Competitor
from benchmarks.workloads import Workload


@dataclass(frozen=True)
class Variant:
    """Ours, with ``training.compile`` on or off and the zygote on or off."""

    name: str
    compile: bool
    warm: bool

    def unavailable(self) -> str | None:
        return None

    @property
    def competitor(self) -> Competitor:
        return Competitor(self.name, "etcd-v3", "" if self.warm else "warm_start=0", ours=True)

    @property
    def workload(self) -> Workload:
        return Workload(ours_overrides=("--training.compile=true",) if self.compile else ())


VARIANTS = (
    Variant("eager-warm", compile=False, warm=True),
    Variant("compiled-warm", compile=True, warm=True),
    Variant("eager-cold", compile=False, warm=False),
    Variant("compiled-cold", compile=True, warm=False),
)


def measure(
    variant: Variant, workdir: Path, *, nodes: int, warmup_steps: int, timeout: float
) -> dict[str, Any]:
    return measure_event(
        variant.competitor, workdir, kind="kill", nodes=nodes, world_after=nodes - 1,
        warmup_steps=warmup_steps, timeout=timeout, workload=variant.workload,
    )  # fmt: skip


def targets(summary: dict[str, dict[str, Any]]) -> list[harness.Target]:
    """No target in the issue: the ratio compiled/eager is reported, not judged."""
    return []


def main(argv: list[str] | None = None) -> None:
    parser = harness.base_parser(__doc__.splitlines()[0], default_repeats=3)
    args = parser.parse_args(argv)
    kwargs: dict[str, Any] = {"nodes": 2, "warmup_steps": 40, "timeout": 300.0}
    if args.smoke:
        kwargs = {"nodes": 2, "warmup_steps": 5, "timeout": 200.0}
    harness.run_benchmark(
        "compile_restart_smoke" if args.smoke else "compile_restart",
        args,
        VARIANTS,
        measure=lambda v, d: measure(v, d, **kwargs),
        metrics=EVENT_METRICS,
        headline="seconds",
        targets=targets,
        settings=kwargs,
        reference="eager-warm",
    )


if __name__ == "__main__":
    main()
