"""Where a throughput difference comes from, for the throughput benchmark's
2-node run: the CPU each process of the run takes per step (workers, agents,
etcd, this driver), and each rank's mean step time at each position of a
cycle of ``--cycle`` steps, which shows what a periodic snapshot or checkpoint
does to the steps after it.

    python -m benchmarks.diagnose --competitors ours,c10d-tuned --repeats 3

Both come from outside the workers (``/proc`` through psutil, and the audit
records' times), so every competitor is diagnosed the same way. One run's
numbers move by about 10 % on a shared 2-core box; compare medians of several
interleaved repetitions, as the table does.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from benchmarks import harness
from benchmarks.cluster import BenchCluster
from benchmarks.throughput import fault_free_run, select

_WORKER_FILE = re.compile(r"^worker-(?P<node>.+)-(?P<pid>\d+)\.jsonl$")


def process_roles(cluster: BenchCluster) -> dict[int, str]:
    """Every process of the run by PID: ``worker nodeN``, ``agent nodeN``, or its name."""
    me = psutil.Process()
    roles = {me.pid: "driver"}
    for child in me.children(recursive=True):
        try:
            roles[child.pid] = child.name().split(":")[0]  # "warm:PID": one row for all
        except psutil.Error:
            continue
    for node in cluster.local.nodes.values():
        roles[node.proc.pid] = f"agent {node.name}"
    for path in cluster.local.audit_dir.glob("worker-*.jsonl"):
        match = _WORKER_FILE.match(path.name)
        if match:
            roles[int(match["pid"])] = f"worker {match['node']}"
    return roles


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each PID still alive."""
    found = {}
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        found[pid] = times.user + times.system
    return found


def measure(comp: Any, workdir: Path, *, warmup: int, window: int, cycle: int) -> dict[str, Any]:
    with fault_free_run(comp, workdir, steps=warmup + window + 100) as cluster:
        cluster.wait_step(warmup, world_size=2, timeout=120)
        roles = process_roles(cluster)
        before, started = cpu_seconds(list(roles)), time.monotonic()
        cluster.wait_step(warmup + window, world_size=2, timeout=600)
        after, seconds = cpu_seconds(list(roles)), time.monotonic() - started
        records = cluster.steps(world_size=2)
    cpu: dict[str, float] = defaultdict(float)
    for pid, used in after.items():
        if pid in before:
            cpu[roles[pid]] += (used - before[pid]) / window * 1e6
    return {
        "steps_per_second": window / seconds,
        "cpu_us_per_step": dict(cpu),
        "step_us_by_position": step_profile(records, first=warmup, cycle=cycle),
    }


def step_profile(records: list[Any], *, first: int, cycle: int) -> dict[str, list[float]]:
    """Per rank: the mean interval between its records of step s-1 and s, by s mod cycle."""
    times: dict[int, dict[int, float]] = defaultdict(dict)
    for record in records:
        times[record.rank][record.step] = record.time
    profile = {}
    for rank, by_step in sorted(times.items()):
        by_position: dict[int, list[float]] = defaultdict(list)
        for step, at in by_step.items():
            if step > first and step - 1 in by_step:
                by_position[step % cycle].append((at - by_step[step - 1]) * 1e6)
        means = [statistics.fmean(by_position[p]) if by_position[p] else 0.0 for p in range(cycle)]
        profile[f"rank {rank}"] = means
    return profile


def table(outcomes: dict[str, harness.Outcome]) -> list[str]:
    """Median over the repetitions of each competitor's per-process CPU and steps/s."""
    rows = ["| competitor | process | CPU µs per step | steps/s |", "|---|---|---|---|"]
    for name, outcome in outcomes.items():
        runs = [r for r in outcome.runs if "error" not in r]
        if not runs:
            rows.append(f"| {name} | n/a | n/a | {outcome.unavailable or 'every run failed'} |")
            continue
        rate = statistics.median(r["steps_per_second"] for r in runs)
        for process in sorted({p for r in runs for p in r["cpu_us_per_step"]}):
            used = statistics.median(r["cpu_us_per_step"].get(process, 0.0) for r in runs)
            rows.append(f"| {name} | {process} | {used:.0f} | {rate:.0f} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = harness.base_parser(__doc__.splitlines()[0], default_repeats=3)
    parser.set_defaults(competitors="ours,c10d-tuned")
    parser.add_argument("--cycle", type=int, default=16, help="steps per profiled cycle")
    args = parser.parse_args(argv)
    kwargs = {"warmup": 300, "window": 2000, "cycle": args.cycle}
    if args.smoke:
        kwargs = {"warmup": 5, "window": 40, "cycle": 4}
    tmp = harness.scratch(args.workdir)
    try:
        outcomes = harness.run_interleaved(
            select(args.competitors, args.rdzv_conf),
            repeats=args.repeats,
            measure=lambda c, d: measure(c, d, **kwargs),
            workdir=Path(tmp.name) if tmp else args.workdir,
        )
    finally:
        if tmp:
            tmp.cleanup()
    print("\n".join(table(outcomes)))
    payload = {"benchmark": "diagnose", "machine": harness.machine(), "settings": kwargs}
    payload["runs"] = {name: asdict(outcome) for name, outcome in outcomes.items()}
    harness.write_results(
        "diagnose_smoke" if args.smoke else "diagnose", payload, out_dir=args.out_dir
    )


if __name__ == "__main__":
    main()
