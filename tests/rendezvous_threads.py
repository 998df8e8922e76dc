"""Run several rendezvous handlers at once, one thread each, as separate agents would."""

from __future__ import annotations

import threading
import time

from torch.distributed.elastic.rendezvous.api import RendezvousHandler


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
