"""Rendezvous latency and etcd load at scale: K simulated agents (threads
that run only the rendezvous handler, no training) against one local etcd, or
one c10d TCPStore, with ``--nnodes K-1:K``.

Per K and backend, one repetition measures:

- ``round_seconds``: all K call ``next_rendezvous`` at once; until the last returns.
- ``idle_requests_per_agent_per_s``: while each agent polls ``num_nodes_waiting``
  every 0.1 s like torchrun's monitor loop (and the handler's own keep-alive
  runs), etcd's requests over an idle window, from etcd's ``/metrics``: gRPC
  messages received (``grpc_server_msg_received_total``, so stream messages
  such as lease keep-alives count too) for v3, HTTP requests
  (``etcd_http_successful_duration_seconds_count`` + ``etcd_http_failed_total``)
  for v2. The c10d store has no such endpoint; ``backend_calls_per_agent_per_s``
  (state reads + writes counted in the backend, one store request each) is
  reported for every backend, so all three compare on that too.
- ``rerendezvous_seconds``: one agent goes silent (its heartbeats stop, as in
  a crash); the other K-1 call ``next_rendezvous`` at once; until the last returns.
- what limits the rounds: state reads, writes and failed compare-and-swaps
  (``cas_conflicts``) per round, next to the handler settings (the 1 s poll of
  torch's join loop, ``last_call_timeout``, heartbeat expiry).

Threads share one Python process, so at large K the simulator's own GIL is
part of what is measured (it is the same for every backend).
``benchmarks.rendezvous_processes`` checks how much: K forked processes, one
handler each, time the first round (kept as ``by_agents_processes`` in this JSON).

Our compare-and-swaps are counted by the backend itself (``cas_attempts``,
``cas_conflicts``), so the join folder's batched writes count too.

The anchors (torch's handlers) are run only up to ``--anchor-max-agents`` (64):
at K = 64 their rounds time out (60 s) or end with inconsistent world sizes, and
each such repetition costs up to a minute; above it they are recorded as not run.

    python -m benchmarks.rendezvous_scale --repeats 3 --agents 2,8,32,64,128,256,512
    python -m benchmarks.rendezvous_processes --competitors ours --agents 32,128
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from benchmarks import harness
from benchmarks.harness import Competitor
from elastic_train.etcd.server import EtcdServer, free_port
from elastic_train.rendezvous.backend import create_handler

METRICS = (
    "round_seconds",
    "idle_requests_per_agent_per_s",
    "backend_calls_per_agent_per_s",
    "rerendezvous_seconds",
    "round_cas_conflicts",
    "rerendezvous_cas_conflicts",
    "round_cas_attempts",
)
TARGET_IDLE_RPS = 0.1
#: torchrun's monitor loop period (``--monitor-interval`` default).
MONITOR_INTERVAL_S = 0.1
#: Bounds a hung round; the settings under test are the last-call and keep-alive ones.
JOIN_TIMEOUT_S = 60


@dataclass
class Counts:
    """Backend calls of one agent: each is one request to etcd or the store."""

    gets: int = 0
    sets: int = 0
    conflicts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    backend: Any = None

    def snapshot(self) -> tuple[int, int, int]:
        with self.lock:
            if hasattr(self.backend, "cas_attempts"):  # ours: every CAS, the folder's too
                return self.gets, self.backend.cas_attempts, self.backend.cas_conflicts
            return self.gets, self.sets, self.conflicts


def count_backend_calls(handler: RendezvousHandler) -> Counts:
    """Wrap the handler's backend so that every state read/write is counted (ours counts
    its own compare-and-swaps, the join folder's included: see :func:`cas_counts`)."""
    backend = handler._state_holder._backend  # type: ignore[attr-defined]
    counts = Counts(backend=backend)
    get_state, set_state = backend.get_state, backend.set_state

    def counted_get() -> Any:
        with counts.lock:
            counts.gets += 1
        return get_state()

    def counted_set(state: bytes, token: Any = None) -> Any:
        result = set_state(state, token)
        with counts.lock:
            counts.sets += 1
            counts.conflicts += int(result is not None and not result[2])
        return result

    backend.get_state, backend.set_state = counted_get, counted_set
    return counts


class Server:
    """The rendezvous server of one repetition and its request counter."""

    def __init__(self, comp: Competitor, workdir: Path) -> None:
        self.comp = comp
        self.etcd: EtcdServer | None = None
        self.store: TCPStore | None = None
        if comp.needs_etcd:
            extra = ["--enable-v2"] if comp.needs_etcd_v2 else []
            self.etcd = EtcdServer(data_dir=workdir / "etcd" / "data", extra_args=extra).start()
            self.endpoint = self.etcd.endpoint
        else:
            port = free_port()
            self.store = TCPStore(
                "127.0.0.1",
                port,
                is_master=True,
                wait_for_workers=False,
                multi_tenant=True,
                timeout=timedelta(seconds=JOIN_TIMEOUT_S),
            )
            self.endpoint = f"127.0.0.1:{port}"

    def requests(self) -> float | None:
        """Requests etcd has received so far (None for the c10d store)."""
        if self.etcd is None:
            return None
        with urllib.request.urlopen(f"{self.etcd.client_url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        names = (
            ("etcd_http_successful_duration_seconds_count", "etcd_http_failed_total")
            if self.comp.needs_etcd_v2
            else ("grpc_server_msg_received_total",)
        )
        pattern = re.compile(rf"^({'|'.join(names)})(\{{[^}}]*\}})? ([0-9.e+]+)$", re.M)
        return sum(float(m.group(3)) for m in pattern.finditer(text))

    def close(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()
        self.store = None


@cache
def _secret_file() -> Path:
    """One job secret for every handler of this process (0600, as a real job's)."""
    fd, path = tempfile.mkstemp(prefix="rdzv-secret-")
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32))
    atexit.register(os.unlink, path)
    return Path(path)


def make_handler(comp: Competitor, endpoint: str, *, run_id: str, k: int) -> RendezvousHandler:
    conf = dict(kv.split("=", 1) for kv in comp.rdzv_conf.split(",") if kv)
    conf.setdefault("join_timeout", str(JOIN_TIMEOUT_S))  # a competitor's own wins
    if comp.rdzv_backend == "c10d":
        conf["is_host"] = "false"
    params = RendezvousParameters(
        backend=comp.rdzv_backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=max(1, k - 1),
        max_nodes=k,
        **conf,
    )
    if comp.ours:  # the bare handler: no node agent (endpoint, zygote) in this process
        params.config.setdefault("secret_file", str(_secret_file()))
        return create_handler(params)
    return get_rendezvous_handler(params)


def all_at_once(calls: list[Callable[[], Any]]) -> tuple[float, list[Any]]:
    """Run every call in its own thread from one start; seconds until the last returned."""
    barrier = threading.Barrier(len(calls) + 1)

    def run(call: Callable[[], Any]) -> Any:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(run, c) for c in calls]
        barrier.wait()
        started = time.monotonic()
        results = [f.result() for f in futures]
        return time.monotonic() - started, results


@contextlib.contextmanager
def monitors(handlers: list[RendezvousHandler]) -> Iterator[None]:
    """Every handler polled like torchrun's monitor loop does while training is healthy."""
    stop = threading.Event()

    def loop(handler: RendezvousHandler) -> None:
        while not stop.wait(MONITOR_INTERVAL_S):
            handler.num_nodes_waiting()

    threads = [threading.Thread(target=loop, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(5)


def totals(counts: list[Counts]) -> tuple[int, int, int]:
    snaps = [c.snapshot() for c in counts]
    return tuple(sum(s[i] for s in snaps) for i in range(3))  # type: ignore[return-value]


def measure(comp: Competitor, workdir: Path, *, k: int, idle_s: float) -> dict[str, Any]:
    server = Server(comp, workdir)
    handlers: list[RendezvousHandler] = []
    try:
        handlers = [make_handler(comp, server.endpoint, run_id=f"scale{k}", k=k) for _ in range(k)]
        counts = [count_backend_calls(h) for h in handlers]
        before = totals(counts)
        round_s, _ = join_all(handlers, k)
        after_round = totals(counts)
        with monitors(handlers):
            requests0, calls0, t0 = server.requests(), totals(counts), time.monotonic()
            time.sleep(idle_s)  # the measurement window itself, not a synchronization
            requests1, calls1, t1 = server.requests(), totals(counts), time.monotonic()
        window = t1 - t0
        handlers[-1]._stop_heartbeats()  # type: ignore[attr-defined]  # a crash: it goes silent
        survivors = handlers[:-1]
        rerdzv_s, _ = join_all(survivors, k - 1)
        after_rerdzv = totals(counts)
    finally:
        for handler in handlers:
            with contextlib.suppress(Exception):
                handler._stop_heartbeats()  # type: ignore[attr-defined]
        server.close()
    idle_requests = None
    if requests0 is not None and requests1 is not None:
        idle_requests = (requests1 - requests0) / window / k
    return {
        "agents": k,
        "handler_settings": settings_of(handlers[0]),
        "round_seconds": round_s,
        "rerendezvous_seconds": rerdzv_s,
        "idle_requests_per_agent_per_s": idle_requests,
        "backend_calls_per_agent_per_s": (sum(calls1[:2]) - sum(calls0[:2])) / window / k,
        "idle_window_seconds": window,
        "round_state_reads": after_round[0] - before[0],
        "round_state_writes": after_round[1] - before[1],
        "round_cas_conflicts": after_round[2] - before[2],
        "round_cas_attempts": after_round[1] - before[1],
        "rerendezvous_state_reads": after_rerdzv[0] - calls1[0],
        "rerendezvous_state_writes": after_rerdzv[1] - calls1[1],
        "rerendezvous_cas_conflicts": after_rerdzv[2] - calls1[2],
    }


def join_all(handlers: list[RendezvousHandler], world_size: int) -> tuple[float, list[Any]]:
    """All handlers join at once; a failure names the state the round was stuck in."""
    try:
        seconds, infos = all_at_once([h.next_rendezvous for h in handlers])
    except Exception as exc:
        state = handlers[0]._state_holder.state  # type: ignore[attr-defined]
        raise RuntimeError(
            f"{type(exc).__name__} for {len(handlers)} agents: round {state.round}, "
            f"{len(state.participants)} participants, {len(state.wait_list)} waiting, "
            f"complete={state.complete}"
        ) from exc
    check_world(infos, world_size)
    return seconds, infos


def check_world(infos: list[Any], world_size: int) -> None:
    """Every agent got the expected world and a distinct rank: the round really completed."""
    ranks = sorted(info.rank for info in infos)
    sizes = {info.world_size for info in infos}
    if sizes != {world_size} or ranks != list(range(world_size)):
        raise RuntimeError(f"bad round: world sizes {sizes}, ranks {ranks}")


def settings_of(handler: RendezvousHandler) -> dict[str, float]:
    """The handler settings in force, read off the handler (what bounds the round times)."""
    settings = handler.settings  # type: ignore[attr-defined]
    return {
        "last_call_timeout": settings.timeout.last_call.total_seconds(),
        "keep_alive_interval": settings.keep_alive_interval.total_seconds(),
        "keep_alive_max_attempt": settings.keep_alive_max_attempt,
        # hard-coded in torch's handler: the join loop's sleep per SYNC action and
        # the state cache of num_nodes_waiting
        "join_poll_seconds": 1.0,
        "state_cache_seconds": 1.0,
    }


class Capped:
    """A competitor not run at this K (``reason``): recorded as unavailable."""

    def __init__(self, comp: Competitor, reason: str) -> None:
        self.comp, self.reason = comp, reason

    @property
    def name(self) -> str:
        return self.comp.name

    def unavailable(self) -> str | None:
        return self.reason


def contenders(comps: list[Competitor], k: int, cap: int) -> list[Competitor | Capped]:
    reason = (
        f"not run above K={cap}: torch's handlers form no consistent round there on this "
        f"box (60 s join timeouts, or inconsistent world sizes), each try up to a minute"
    )
    return [c if c.ours or k <= cap else Capped(c, reason) for c in comps]


def main(argv: list[str] | None = None) -> None:
    parser = harness.base_parser(__doc__.splitlines()[0], default_repeats=3)
    parser.set_defaults(competitors="ours,c10d-tuned,etcd-v2-tuned")
    parser.add_argument("--agents", default="2,8,32,128", help="comma-separated K values")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="idle window per run")
    parser.add_argument("--anchor-max-agents", type=int, default=64, help="largest K for anchors")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.agents.split(",")]
    idle_s = args.idle_seconds
    if args.smoke:
        ks, idle_s = [2], 2.0
    competitors = harness.select_competitors(args.competitors, args.rdzv_conf)
    tmp = harness.scratch(args.workdir)
    workdir = Path(tmp.name) if tmp else args.workdir
    try:
        _threads(args, ks, idle_s, competitors, workdir)
    finally:
        if tmp:
            tmp.cleanup()


def _threads(
    args: Any, ks: list[int], idle_s: float, competitors: list[Competitor], workdir: Path
) -> None:
    started, host = time.time(), harness.machine()
    by_k: dict[str, Any] = {}
    for k in ks:
        outcomes = harness.run_interleaved(
            contenders(competitors, k, args.anchor_max_agents),
            repeats=args.repeats,
            measure=lambda c, d, k=k: measure(c, d, k=k, idle_s=idle_s),
            workdir=workdir / f"k{k}",
        )
        summary = harness.summarize_outcomes(outcomes, METRICS)
        by_k[str(k)] = {"summary": summary, "runs": {n: asdict(o) for n, o in outcomes.items()}}
        # written after every K, so a late failure keeps the rounds already measured
        payload = {
            "benchmark": "rendezvous_scale_smoke" if args.smoke else "rendezvous_scale",
            "started": started,
            "finished": time.time(),
            "machine": host,
            "repeats": args.repeats,
            "settings": {
                "agents": ks,
                "mode": "threads",
                "idle_seconds": idle_s,
                "monitor_interval": MONITOR_INTERVAL_S,
                "join_timeout": JOIN_TIMEOUT_S,
                "anchor_max_agents": args.anchor_max_agents,
            },
            "rdzv_conf": {c.name: c.rdzv_conf for c in competitors},
            "by_agents": by_k,
            "targets": [t.to_json() for t in targets(by_k)],
        }
        path = harness.write_results(payload["benchmark"], payload, out_dir=args.out_dir)
    keep_processes_check(path)


def keep_processes_check(path: Path) -> None:
    """Carry the last processes check over into a rewritten threads result."""
    side = path.with_name(path.stem + "_processes.json")
    if side.exists():
        payload = json.loads(path.read_text())
        payload["by_agents_processes"] = json.loads(side.read_text())
        path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def targets(by_k: dict[str, Any]) -> list[harness.Target]:
    """Idle etcd load per agent at the largest K where ours completed its rounds."""
    metric = "idle_requests_per_agent_per_s"
    measured = [
        k for k in by_k if harness.median_of(by_k[k]["summary"], "ours", metric) is not None
    ]
    if not measured:
        return [harness.Target("ours idle etcd requests/s per agent", None, TARGET_IDLE_RPS)]
    k = max(measured, key=int)
    value = harness.median_of(by_k[k]["summary"], "ours", metric)
    return [harness.Target(f"ours idle etcd requests/s per agent (K={k})", value, TARGET_IDLE_RPS)]


if __name__ == "__main__":
    main()
