"""The GIL check of ``benchmarks.rendezvous_scale``: K agents in K forked processes.

The scale benchmark runs its K agents as threads of one process, so at large K
the simulator's GIL is part of what it measures. Here each agent is a process of
its own (forked after the imports, so they share torch's pages: K = 128 fits in a
few GB), and only the first round is timed, from the moment all K are ready to
the last agent's return. The result goes beside the threads result
(``rendezvous_scale_processes.json``) and into it (``by_agents_processes``).

    python -m benchmarks.rendezvous_processes --competitors ours --agents 32,64,128
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import Competitor
from benchmarks.rendezvous_scale import (
    JOIN_TIMEOUT_S,
    Server,
    _secret_file,
    check_world,
    contenders,
    keep_processes_check,
    make_handler,
)


def _agent_process(
    comp: Competitor, endpoint: str, k: int, barrier: Any, results: Any, done: Any
) -> None:
    """One forked agent: a handler, one round, its timing and counters; then waits."""
    handler = make_handler(comp, endpoint, run_id=f"proc{k}", k=k)
    backend = handler._state_holder._backend  # type: ignore[attr-defined]
    barrier.wait()
    started = time.time()  # one host: wall clocks of the processes agree
    info = handler.next_rendezvous()
    results.put(
        {
            "rank": info.rank,
            "world_size": info.world_size,
            "started": started,
            "ended": time.time(),
            "cas_attempts": getattr(backend, "cas_attempts", 0),
            "cas_conflicts": getattr(backend, "cas_conflicts", 0),
        }
    )
    done.wait(JOIN_TIMEOUT_S * 2)  # stay a participant until every agent has its round
    os._exit(0)


def measure_processes(comp: Competitor, workdir: Path, *, k: int) -> dict[str, Any]:
    """The first round of K agents, each in its own forked process (no shared GIL)."""
    if comp.ours:
        _secret_file()  # made before the fork: one job secret for every agent
    server = Server(comp, workdir)
    ctx = multiprocessing.get_context("fork")  # the parent holds no gRPC channel
    barrier, results, done = ctx.Barrier(k), ctx.Queue(), ctx.Event()
    args = (comp, server.endpoint, k, barrier, results, done)
    procs = [ctx.Process(target=_agent_process, args=args, daemon=True) for _ in range(k)]
    try:
        for proc in procs:
            proc.start()
        runs = [results.get(timeout=JOIN_TIMEOUT_S * 2) for _ in range(k)]
    finally:
        done.set()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        server.close()
    check_world([_Info(r["rank"], r["world_size"]) for r in runs], k)
    return {
        "agents": k,
        "mode": "processes",
        "round_seconds": max(r["ended"] for r in runs) - min(r["started"] for r in runs),
        "round_cas_attempts": sum(r["cas_attempts"] for r in runs),
        "round_cas_conflicts": sum(r["cas_conflicts"] for r in runs),
    }


@dataclass(frozen=True)
class _Info:
    rank: int
    world_size: int


def processes_check(args: Any, ks: list[int], competitors: list[Competitor], workdir: Path) -> None:
    """Rounds with one process per agent, written beside the threads result and into it."""
    by_k: dict[str, Any] = {}
    for k in ks:
        outcomes = harness.run_interleaved(
            contenders(competitors, k, args.anchor_max_agents),
            repeats=args.repeats,
            measure=lambda c, d, k=k: measure_processes(c, d, k=k),
            workdir=workdir / f"p{k}",
        )
        metrics = ("round_seconds", "round_cas_attempts", "round_cas_conflicts")
        summary = harness.summarize_outcomes(outcomes, metrics)
        by_k[str(k)] = {"summary": summary, "runs": {n: asdict(o) for n, o in outcomes.items()}}
    payload = {"machine": harness.machine(), "repeats": args.repeats, "by_agents": by_k}
    out_dir = args.out_dir or harness.RESULTS_DIR
    side = Path(out_dir) / "rendezvous_scale_processes.json"
    side.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    main_result = Path(out_dir) / "rendezvous_scale.json"
    if main_result.exists():
        keep_processes_check(main_result)


def main(argv: list[str] | None = None) -> None:
    parser = harness.base_parser(__doc__.splitlines()[0], default_repeats=3)
    parser.set_defaults(competitors="ours,c10d-tuned")
    parser.add_argument("--agents", default="32,64,128", help="comma-separated K values")
    parser.add_argument("--anchor-max-agents", type=int, default=64, help="largest K for anchors")
    args = parser.parse_args(argv)
    ks = [2] if args.smoke else [int(k) for k in args.agents.split(",")]
    tmp = harness.scratch(args.workdir)
    try:
        workdir = Path(tmp.name) if tmp else args.workdir
        processes_check(args, ks, harness.select_competitors(args.competitors), workdir)
    finally:
        if tmp:
            tmp.cleanup()


if __name__ == "__main__":
    main()
