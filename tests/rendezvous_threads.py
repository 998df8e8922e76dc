"""Run several rendezvous handlers at once, one thread each, as separate agents would."""

from __future__ import annotations

import threading
import time
import urllib.request
import uuid
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousHandler

from elastic_train.etcd.server import EtcdServer
from elastic_train.rendezvous import backend as rendezvous
from elastic_train.rendezvous.backend import EtcdV3RendezvousHandler

_made: list[EtcdV3RendezvousHandler] = []
#: the name torch gives a handler's heartbeat thread (dynamic_rendezvous._start_heartbeats)
KEEP_ALIVE_THREAD = "RendezvousKeepAliveTimer_"


def make_handlers(
    endpoint: str, count: int, *, run_prefix: str, min_nodes: int, max_nodes: int, **conf: object
) -> list[EtcdV3RendezvousHandler]:
    """``count`` handlers of one fresh run (``last_call_timeout`` 1 s unless given).

    Call ``stop_handlers()`` after the test: a handler's heartbeat timer runs
    until its agent stops it.
    """
    run_id = f"{run_prefix}-{uuid.uuid4().hex[:8]}"
    handlers = [
        rendezvous.create_handler(
            RendezvousParameters(
                "etcd-v3", endpoint, run_id, min_nodes, max_nodes,
                **{"last_call_timeout": 1, **conf},
            )
        )
        for _ in range(count)
    ]  # fmt: skip
    _made.extend(handlers)
    return handlers


def stop_handlers() -> None:
    """Stop every handler made so far, as each agent would on its way out.

    Without this a handler's keep-alive thread kept beating after the test, and
    after the session's etcd stopped it logged into closed streams.
    """
    while _made:
        handler = _made.pop()
        handler._stop_heartbeats()
        handler._etcd_backend.close()
    beating = [t.name for t in threading.enumerate() if t.name.startswith(KEEP_ALIVE_THREAD)]
    assert not beating, f"heartbeat threads still running after the test: {beating}"


def kill(handler: RendezvousHandler) -> None:
    """What SIGKILL does to an agent's handler: its heartbeat timer stops for good."""
    handler._stop_heartbeats()  # type: ignore[attr-defined]


def poll_until(
    condition: Callable[[], bool], *, within: float, what: str, every: float = 0.02
) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        time.sleep(every)


def join_all(handlers: list[RendezvousHandler], *, within: float) -> list[tuple[int, int]]:
    """Run next_rendezvous on each handler in a thread; each one's (rank, world_size).

    Re-raises the first handler's error; fails if some handler has no round within
    ``within`` seconds.
    """
    results: list[tuple[int, int] | BaseException | None] = [None] * len(handlers)

    def join(i: int) -> None:
        try:
            info = handlers[i].next_rendezvous()
            results[i] = (info.rank, info.world_size)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + within
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for result in results:
        if isinstance(result, BaseException):
            raise result
    assert all(r is not None for r in results), f"no round within {within} s: {results}"
    return results  # type: ignore[return-value]


def etcd_requests(server: EtcdServer) -> float:
    """The gRPC messages ``server`` has received so far (its own metrics)."""
    with urllib.request.urlopen(f"{server.client_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("grpc_server_msg_received_total")
    )
