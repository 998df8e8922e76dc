"""Side rounds: a node entering a job whose in-process group runs joins it asynchronously.

Without them a node that arrives while training runs waits in the rendezvous,
and its wait makes every agent stop and restart its workers to form a round
with it (4-5 s of stall for the survivors here). With ``elastic.recovery =
"inprocess"`` the running group's rank 0 keeps a marker in etcd
(:mod:`elastic_train.etcd.group_marker`). When the marker's head answers a
ping, :func:`attach_side_rounds` gives torchrun's agent a round of its own
instead: this node alone, on a fresh prefix of the rendezvous store, and
:data:`ASYNC_JOIN_ENV` for its workers, which then ask the group to admit
them at a step boundary (``training/admission.py``). The other agents never
see a waiting node and keep their workers.

Contract of the wrapped ``next_rendezvous``: it returns a side round only when
the marker is signed by the job secret, its head answers within
:data:`PROBE_TIMEOUT_S`, the group has fewer than ``--nnodes``' maximum
nodes, nobody waits in the rendezvous and this node's round (if any) has not
ended (then every agent restarts for a new round, the group's included);
otherwise it is the handler's own round (and the variable is removed,
so a later round's workers join normally). A side round is never a member of
the rendezvous state: its agent's exit barrier is its own, and the group's
final rank 0 arrives at the round's barrier for the node it replaced
(``training/exit_barrier.py``).
"""

from __future__ import annotations

import json
import os
import uuid
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo

from elastic_train.errors import EtcdError
from elastic_train.log import get_logger

if TYPE_CHECKING:
    from elastic_train.rendezvous.backend import EtcdV3RendezvousHandler

log = get_logger(__name__)

#: Set in the agent for the workers of a side round: JSON of the marker (the group's
#: lineage, generation, and where its head answers).
ASYNC_JOIN_ENV = "ELASTIC_TRAIN_ASYNC_JOIN"
#: Seconds the running group's head has to answer the ping.
PROBE_TIMEOUT_S = 1.0


def attach_side_rounds(handler: EtcdV3RendezvousHandler, *, max_nodes: int) -> None:
    """Wrap ``handler.next_rendezvous`` as the module docstring says."""
    join = handler.next_rendezvous

    def next_rendezvous() -> RendezvousInfo:
        try:
            group = handler.running_group(probe_timeout=PROBE_TIMEOUT_S)
        except EtcdError as exc:  # the round's own path rides out outages
            log.warning("rendezvous_side_round_unavailable", error=str(exc))
            group = None
        # Somebody waits, or this node's round ended: every agent restarts for a
        # new round, the group with them (its head may not have noticed yet).
        if group is None or group.nodes >= max_nodes or handler.num_nodes_waiting() > 0:
            os.environ.pop(ASYNC_JOIN_ENV, None)
            return join()
        name = f"elastic_train.side.{uuid.uuid4().hex}"
        store = dist.PrefixStore(name, handler.base_store)
        addr = handler.node_addr
        info = RendezvousInfo(store, 0, 1, RendezvousStoreInfo.build(0, store, local_addr=addr))
        os.environ[ASYNC_JOIN_ENV] = json.dumps({
            "lineage": group.lineage, "generation": group.generation,
            "host": group.host, "ping_port": group.ping_port,
        })  # fmt: skip
        log.info(
            "rendezvous_side_round", lineage=group.lineage, generation=group.generation,
            group_nodes=group.nodes, store=name,
        )  # fmt: skip
        return info

    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]
