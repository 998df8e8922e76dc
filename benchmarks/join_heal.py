"""Join stall with the state broadcast at the switch against a heal (#20 item 2).

``nodes`` nodes train in process, one more node starts and is admitted at a
step boundary (an async join). Two variants of ours, interleaved:

- ``broadcast`` (``elastic.heal_joins=false``): at the switch the members
  broadcast the whole state, and everybody waits for it;
- ``heal`` (the default): the members take the next step on their own shares
  of the batch while rank 0 sends the joiner the model and the optimizer
  (``training/heal.py``).

Per run, from the members' logs and rank 0's audit records: the members'
switch (``inprocess_admitted.seconds``, median over the members), the stall
(rank 0's records of the step before the switch to two steps after it, less
two median steps at the new world size: the switch, the heal step's larger
shares, and the joiner's catching up all count) in ms and in steps, and (heal) the
size of what rank 0 sent. ``--hidden-size`` makes the state larger (1024: about 13 MB
with AdamW's moments).

    python -m benchmarks.join_heal --repeats 5 --hidden-size 1024
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.events import measure_event
from benchmarks.harness import Competitor
from benchmarks.workloads import Workload

METRICS = ("stall_ms", "stall_steps", "switch_ms", "step_ms", "state_bytes", "seconds")
FULL: dict[str, Any] = {"nodes": 3, "warmup_steps": 60, "timeout": 120.0}
SMOKE: dict[str, Any] = {"nodes": 1, "warmup_steps": 5, "timeout": 60.0}
#: Steps at the new world size whose median is the step time (after the stall).
_STEADY = range(5, 45)


@dataclass(frozen=True)
class Variant:
    """Ours, with the joiners' state broadcast at the switch or healed during a step."""

    heal: bool

    @property
    def name(self) -> str:
        return "heal" if self.heal else "broadcast"

    def unavailable(self) -> str | None:
        return harness.COMPETITORS["ours"].unavailable()


def measure(variant: Variant, workdir: Path, *, hidden_size: int, **event: Any) -> dict[str, Any]:
    overrides = (
        "--elastic.recovery=inprocess",
        f"--elastic.heal_joins={str(variant.heal).lower()}",
    )
    workload = Workload(hidden_size=hidden_size, ours_overrides=overrides)
    ours: Competitor = harness.COMPETITORS["ours"]
    nodes = event["nodes"]
    rec = measure_event(
        ours, workdir, kind="join", world_after=nodes + 1, workload=workload,
        settle_steps=_STEADY.stop + 5, **event,
    )  # fmt: skip
    return {"seconds": rec["seconds"], **stall(workdir)}


def stall(run_dir: Path) -> dict[str, Any]:
    """The members' switch and rank 0's stall around it (see the module docstring)."""
    admitted = [e for path in sorted((run_dir / "logs").glob("node*.log"))
                for e in _events(path) if e.get("event") == "inprocess_admitted"]  # fmt: skip
    if not admitted:
        raise ValueError(f"no member logged inprocess_admitted under {run_dir}")
    switch_step = admitted[0]["step"]
    times = _rank0_step_times(run_dir)
    steady = [times[switch_step + i + 1] - times[switch_step + i] for i in _STEADY
              if switch_step + i + 1 in times and switch_step + i in times]  # fmt: skip
    step_s = statistics.median(steady)
    stall_s = times[switch_step + 2] - times[switch_step] - 2 * step_s
    sizes = [e["bytes"] for path in (run_dir / "logs").glob("node*.log") for e in _events(path)
             if e.get("event") == "inprocess_heal_sent"]  # fmt: skip
    return {
        "switch_ms": 1000 * statistics.median(e["seconds"] for e in admitted),
        "stall_ms": 1000 * stall_s,
        "stall_steps": stall_s / step_s,
        "step_ms": 1000 * step_s,
        "state_bytes": max(sizes) if sizes else None,
        "switch_step": switch_step,
    }


def _rank0_step_times(run_dir: Path) -> dict[int, float]:
    """Step -> time of rank 0's first record of it (node0 is rank 0 before and after)."""
    times: dict[int, float] = {}
    for path in (run_dir / "audit").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == "step" and record["rank"] == 0:
                times.setdefault(record["step"], record["time"])
    return times


def _events(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text(errors="replace").splitlines()
    return [json.loads(line) for line in lines if line.startswith("{") and '"event"' in line]


def main(argv: list[str] | None = None) -> None:
    parser = harness.base_parser(__doc__.splitlines()[0], default_repeats=5)
    parser.set_defaults(competitors="broadcast,heal")
    parser.add_argument("--hidden-size", type=int, default=Workload.hidden_size)
    args = parser.parse_args(argv)
    kwargs = SMOKE if args.smoke else FULL
    names = [n.strip() for n in args.competitors.split(",") if n.strip()]
    if not set(names) <= {"broadcast", "heal"}:
        raise SystemExit(f"--competitors: {names}; accepted values: broadcast, heal")
    harness.run_benchmark(
        "join_heal_smoke" if args.smoke else f"join_heal_h{args.hidden_size}",
        args,
        [Variant(heal=n == "heal") for n in names],
        measure=lambda v, d: measure(v, d, hidden_size=args.hidden_size, **kwargs),
        metrics=METRICS,
        headline="stall_ms",
        targets=lambda s: [harness.Target("heal median stall, steps",
                                          harness.median_of(s, "heal", "stall_steps"), 1.0)],
        settings={**kwargs, "hidden_size": args.hidden_size},
        reference="broadcast",
    )  # fmt: skip


if __name__ == "__main__":
    main()
