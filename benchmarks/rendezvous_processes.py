"""The GIL check of ``benchmarks.rendezvous_scale``: K agents in K forked processes.

The scale benchmark runs its K agents as threads of one process, so at large K
the simulator's GIL is part of what it measures. Here each agent is a process of
its own (forked after the imports, so they share torch's pages: K = 128 fits in a
few GB), and only the first round is timed, from the moment all K are ready to
the last agent's return. The result goes beside the threads result
(``rendezvous_scale_processes.json``) and into it (``by_agents_processes``).

``--agents-per-process N`` runs N agents as threads of each forked process: at
K = 512 one process holds 2 000 threads that convoy on gRPC's per-call lock, and
512 processes do not fit beside the other work of a 2-core box; 16 x 32 do.

    python -m benchmarks.rendezvous_processes --competitors ours --agents 32,64,128
    python -m benchmarks.rendezvous_processes --agents 512 --agents-per-process 32
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import threading
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
    comp: Competitor, endpoint: str, agents: tuple[int, int], sync: tuple[Any, Any, Any]
) -> None:
    """One forked process with ``agents[1]`` agents (threads), each a handler and one round.

    ``agents``: (K of the job, agents in this process); ``sync``: the start barrier,
    the results queue and the event that ends the process once every agent has its round.
    """
    k, count = agents
    barrier, results, done = sync
    handlers = [make_handler(comp, endpoint, run_id=f"proc{k}", k=k) for _ in range(count)]
    barrier.wait()

    def one(handler: Any) -> None:
        backend = handler._state_holder._backend
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

    threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in handlers]
    for thread in threads:
        thread.start()
    done.wait(_join_timeout(comp) * 2)  # stay a participant until every agent has its round
    os._exit(0)


def _join_timeout(comp: Competitor) -> float:
    conf = dict(kv.split("=", 1) for kv in comp.rdzv_conf.split(",") if kv)
    return float(conf.get("join_timeout", JOIN_TIMEOUT_S))


def with_timeouts(
    comp: Competitor, *, read_timeout: float | None, join_timeout: float | None
) -> Competitor:
    """``comp`` with its agents' etcd ``read_timeout`` and round ``join_timeout`` set:
    hundreds of agents sharing 2 cores wait on the CPU, not on etcd, for longer than
    the 5 s a request of a real agent on its own host gets by default."""
    extra = [f"read_timeout={read_timeout}"] if read_timeout and comp.ours else []
    extra += [f"join_timeout={int(join_timeout)}"] if join_timeout else []
    if not extra:
        return comp
    return dataclasses.replace(comp, rdzv_conf=",".join(filter(None, [comp.rdzv_conf, *extra])))


def split(k: int, per_process: int) -> list[int]:
    """K agents over ceil(K / per_process) processes, as evenly as possible."""
    procs = -(-k // max(1, per_process))
    return [k // procs + (i < k % procs) for i in range(procs)]


def measure_processes(
    comp: Competitor, workdir: Path, *, k: int, per_process: int = 1
) -> dict[str, Any]:
    """The first round of K agents, ``per_process`` of them (threads) per forked process."""
    if comp.ours:
        _secret_file()  # made before the fork: one job secret for every agent
    server = Server(comp, workdir)
    ctx = multiprocessing.get_context("fork")  # the parent holds no gRPC channel
    counts = split(k, per_process)
    sync = (ctx.Barrier(len(counts)), ctx.Queue(), ctx.Event())
    procs = [
        ctx.Process(target=_agent_process, args=(comp, server.endpoint, (k, n), sync), daemon=True)
        for n in counts
    ]
    try:
        for proc in procs:
            proc.start()
        runs = [sync[1].get(timeout=_join_timeout(comp) * 2) for _ in range(k)]
    finally:
        sync[2].set()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        server.close()
    check_world([_Info(r["rank"], r["world_size"]) for r in runs], k)
    return {
        "agents": k,
        "mode": "processes",
        "processes": len(counts),
        "agents_per_process": max(counts),
        "round_seconds": max(r["ended"] for r in runs) - min(r["started"] for r in runs),
        "round_cas_attempts": sum(r["cas_attempts"] for r in runs),
        "round_cas_conflicts": sum(r["cas_conflicts"] for r in runs),
    }


@dataclass(frozen=True)
class _Info:
    rank: int
    world_size: int


def processes_check(args: Any, ks: list[int], competitors: list[Competitor], workdir: Path) -> None:
    """Rounds with agents in forked processes, written beside the threads result and into it."""
    per_process = getattr(args, "agents_per_process", 1)
    by_k: dict[str, Any] = {}
    for k in ks:
        outcomes = harness.run_interleaved(
            contenders(competitors, k, args.anchor_max_agents),
            repeats=args.repeats,
            measure=lambda c, d, k=k: measure_processes(c, d, k=k, per_process=per_process),
            workdir=workdir / f"p{k}",
        )
        metrics = ("round_seconds", "round_cas_attempts", "round_cas_conflicts")
        summary = harness.summarize_outcomes(outcomes, metrics)
        by_k[str(k)] = {"summary": summary, "runs": {n: asdict(o) for n, o in outcomes.items()}}
    payload = {
        "machine": harness.machine(),
        "repeats": args.repeats,
        "agents_per_process": per_process,
        "rdzv_conf": {c.name: c.rdzv_conf for c in competitors},
        "by_agents": by_k,
    }
    out_dir = args.out_dir or harness.RESULTS_DIR
    Path(out_dir).mkdir(parents=True, exist_ok=True)
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
    parser.add_argument(
        "--agents-per-process",
        type=int,
        default=1,
        help="agents (threads) per forked process: 1 is one process per agent; 8 runs K = 512 "
        "as 64 processes, so that neither one GIL nor 512 processes' memory is the limit",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=None,
        help="ours' rdzv-conf read_timeout for every simulated agent (s)",
    )
    parser.add_argument(
        "--join-timeout",
        type=int,
        default=None,
        help=f"every agent's rdzv join_timeout (s; default {JOIN_TIMEOUT_S})",
    )
    args = parser.parse_args(argv)
    ks = [2] if args.smoke else [int(k) for k in args.agents.split(",")]
    tmp = harness.scratch(args.workdir)
    try:
        workdir = Path(tmp.name) if tmp else args.workdir
        competitors = [
            with_timeouts(c, read_timeout=args.read_timeout, join_timeout=args.join_timeout)
            for c in harness.select_competitors(args.competitors, args.rdzv_conf)
        ]
        processes_check(args, ks, competitors, workdir)
    finally:
        if tmp:
            tmp.cleanup()


if __name__ == "__main__":
    main()
