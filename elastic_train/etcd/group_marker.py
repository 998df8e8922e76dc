"""The running in-process group's marker in etcd, and the ping its members answer.

With ``elastic.recovery = "inprocess"`` the group's rank 0 keeps one key,
``{run_prefix}/inprocess/active``: the lineage of the group (where its
generations live in etcd), its generation, its number of nodes, and the host
and port where its head answers a one-byte ping. A node (re)entering the job
reads it (``rendezvous/side_round.py``): when the head answers, the node's
agent runs a round of its own and its workers ask the running group to admit
them at a step boundary (``training/admission.py``), instead of waiting in the
rendezvous, which makes every agent restart its workers.

The value is framed by the job's :class:`~elastic_train.etcd.codec.ValueCodec`
(signed with the rendezvous secret) like every other value of the job.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass

from elastic_train.errors import EtcdValueRejectedError
from elastic_train.etcd.client import EtcdClient
from elastic_train.etcd.codec import ValueCodec
from elastic_train.log import get_logger

log = get_logger(__name__)

#: Under the run prefix ``{key_prefix}/{run_id}``.
ACTIVE_KEY = "inprocess/active"
PING, PONG = b"?", b"!"


@dataclass(frozen=True)
class ActiveGroup:
    """What the marker says: the group's lineage and generation, and its head."""

    lineage: str
    generation: int
    nodes: int
    host: str
    ping_port: int


def answers(host: str, port: int, *, timeout: float) -> bool:
    """Whether the liveness responder at ``host:port`` answers a ping within ``timeout`` s."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            conn.sendall(PING)
            return conn.recv(1) == PONG
    except OSError:
        return False


def _key(run_prefix: str) -> bytes:
    return f"{run_prefix}/{ACTIVE_KEY}".encode()


def write_active(
    client: EtcdClient, codec: ValueCodec, run_prefix: str, group: ActiveGroup
) -> None:
    key = _key(run_prefix)
    client.put(key, codec.encode(key, json.dumps(asdict(group)).encode()))


def read_active(client: EtcdClient, codec: ValueCodec, run_prefix: str) -> ActiveGroup | None:
    """The marker, or None when there is none or it cannot be trusted (logged by the
    codec: a value that fails its MAC is never used)."""
    key = _key(run_prefix)
    kv, _ = client.get(key)
    if kv is None:
        return None
    try:
        return ActiveGroup(**json.loads(codec.decode(key, kv.value)))
    except (EtcdValueRejectedError, ValueError, TypeError) as exc:
        log.warning("inprocess_marker_unreadable", key=key.decode(), error=str(exc))
        return None


def clear_active(client: EtcdClient, codec: ValueCodec, run_prefix: str, lineage: str) -> None:
    """Delete the marker if it is still ``lineage``'s (a later group may have replaced it)."""
    current = read_active(client, codec, run_prefix)
    if current is not None and current.lineage == lineage:
        client.delete(_key(run_prefix))


def alive_group(
    client: EtcdClient, codec: ValueCodec, run_prefix: str, *, timeout: float
) -> ActiveGroup | None:
    """The marked group when its head answers a ping within ``timeout`` s, else None."""
    group = read_active(client, codec, run_prefix)
    if group is None or not answers(group.host, group.ping_port, timeout=timeout):
        return None
    return group
