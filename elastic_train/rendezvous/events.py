"""torch's rendezvous events, named without ``inspect.stack()``."""

from __future__ import annotations

import sys

from torch.distributed.elastic.events import NodeState, construct_and_record_rdzv_event
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

__all__ = ["record_event"]


def record_event(
    owner: object,
    *,
    run_id: str,
    message: str,
    node_state: NodeState,
    node: _NodeDesc | None = None,
    rank: int | None = None,
) -> None:
    """torch's rendezvous event, named after the method that called ``owner._record``.

    torch names it with ``inspect.stack()``, twice, even when nothing records
    events (the default): that reads the source of every frame, milliseconds per
    action, and the join spends them between reading the state and writing it
    back, which widens the window in which other writers make it lose.
    """
    caller = sys._getframe(2).f_code.co_name
    construct_and_record_rdzv_event(
        name=f"{type(owner).__name__}.{caller}",
        run_id=run_id,
        message=message,
        node_state=node_state,
        hostname=node.addr if node else "",
        pid=node.pid if node else None,
        local_id=node.local_id if node else None,
        rank=rank,
    )
