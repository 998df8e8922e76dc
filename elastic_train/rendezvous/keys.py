"""``EtcdV3RendezvousBackend``: torch's rendezvous state in one etcd key, and one
heartbeat key per node beside it, every value framed and checked by the job's
:class:`~elastic_train.etcd.codec.ValueCodec`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic_train.errors import EtcdError, EtcdUnavailableError, EtcdValueRejectedError
from elastic_train.etcd.client import EtcdClient, KeyValue
from elastic_train.etcd.codec import ValueCodec, read_verified
from elastic_train.etcd.sync import LeaseKeeper, WatchedKey, close_with
from elastic_train.log import get_logger

__all__ = ["EtcdV3RendezvousBackend"]

log = get_logger(__name__)

T = TypeVar("T")


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Holds torch's rendezvous state in one etcd key; the fencing token is its mod_revision.

    Heartbeats live beside it, one key per node (:meth:`beat`, :meth:`heartbeats`):
    written into the one state key, K agents' heartbeats take most of the
    compare-and-swaps a round needs, and at K = 64 the joins starved.

    Every value goes through ``codec``; a refused state raises torch's
    ``RendezvousStateError`` (the agent reports it by type) after at most two
    fresh reads (:func:`~elastic_train.etcd.codec.read_verified`).

    Args:
        client: the etcd client.
        name: the backend name torchrun was asked for (``etcd-v3`` or ``etcd``).
        key: the etcd key of the state.
        heartbeats: the prefix of the nodes' heartbeat keys.
        ttl: seconds the keys outlive the last agent (a lease, renewed while one runs).
        codec: frames and checks every value (the job secret, or unsigned).
    """

    def __init__(
        self,
        client: EtcdClient,
        *,
        name: str,
        key: str,
        heartbeats: str,
        ttl: int = 7200,
        codec: ValueCodec,
    ) -> None:
        self._client = client
        self._name = name
        self._key = key.encode()
        self._beats_prefix = heartbeats.encode()
        self._lease = LeaseKeeper(client, ttl)
        # Agents write the state only during a rendezvous, so a job that runs
        # for longer than ttl without one must still keep its state key.
        self._lease.renew_in_background()
        self._codec = codec
        self._seen_revision = 0  # of the state last handed to the handler
        # A counter, not a time: readers only ever compare it with its own earlier
        # values. Started from this process's clock so that a later agent reusing
        # a node name (a recycled pid) starts above the earlier one.
        self._beat_count = time.time_ns()
        self._beats_seen: dict[str, tuple[int, float]] = {}  # node: (count, first seen)
        # torch's handler polls get_state about once a second per agent; a watched
        # copy answers those polls without a request while nothing changes.
        self._state = WatchedKey(client, self._key)
        close_with(self, self._state, self._lease)

    @property
    def name(self) -> str:
        return self._name

    def close(self) -> None:
        """Stop watching the state key (reads still work, straight from etcd)."""
        self._state.close()
        self._lease.stop_renewing()

    def get_state(self) -> tuple[bytes, Token] | None:
        verified = self._verified(self._etcd(self._state.read))
        if verified is None:
            self._seen_revision = 0
            return None
        payload, current = verified
        self._seen_revision = current.mod_revision
        return payload, current.mod_revision

    def _verified(self, value: KeyValue | None) -> tuple[bytes, KeyValue] | None:
        """The checked payload of the state ``value`` (re-read from etcd if refused)."""
        try:
            return read_verified(
                self._codec,
                self._key,
                value,
                lambda: self._etcd(lambda: self._client.get(self._key)[0]),
            )
        except EtcdValueRejectedError as exc:
            raise RendezvousStateError(str(exc)) from exc

    def wait_for_change(self, timeout: float) -> bool:
        """Block until the state is newer than the one last returned, or ``timeout``."""
        return self._state.wait_newer(self._seen_revision, timeout)

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        revision = 0 if token is None else _parse_token(token)
        if revision is None:  # invalid: write nothing, report the current state
            current = self.get_state()
            return None if current is None else (*current, False)
        encoded = self._codec.encode(self._key, state)
        written, current, new_revision = self._etcd(
            lambda: self._lease.run(
                lambda lease: self._client.put_if_revision(
                    self._key, encoded, mod_revision=revision, lease=lease
                )
            )
        )
        if written:
            self._state.offer(KeyValue(self._key, encoded, new_revision))
            self._seen_revision = new_revision
            return state, new_revision, True
        verified = self._verified(current)
        if verified is None:
            self._seen_revision = 0
            return None
        payload, current = verified
        self._state.offer(current)
        self._seen_revision = current.mod_revision
        return payload, current.mod_revision, False

    def _etcd(self, request: Callable[[], T]) -> T:
        try:
            return request()
        except EtcdUnavailableError as exc:
            raise RendezvousConnectionError(f"etcd is unreachable: {exc}") from exc
        except EtcdError as exc:
            raise RendezvousConnectionError(str(exc)) from exc

    def beat(self, node: str) -> None:
        """Advance ``node``'s signed heartbeat counter: one put of its own key, no state write."""
        key = self._beat_key(node)
        self._beat_count += 1
        value = self._codec.encode(key, str(self._beat_count).encode())
        self._etcd(lambda: self._lease.run(lambda lease: self._client.put(key, value, lease=lease)))

    def forget(self, node: str) -> None:
        """Delete ``node``'s heartbeat key (the node is leaving the job)."""
        self._etcd(lambda: self._client.delete(self._beat_key(node)))

    def _beat_key(self, node: str) -> bytes:
        return self._beats_prefix + node.encode()

    def heartbeats(self) -> dict[str, float]:
        """Per node, the ``time.monotonic()`` at which this backend first saw its current counter.

        Only this process's clock is involved. Refused values (forged, another
        secret) and counters that went backwards (a replayed older value) are
        no sign of life: the node just looks older.
        """
        found, _ = self._etcd(lambda: self._client.get_prefix(self._beats_prefix))
        now = time.monotonic()
        seen: dict[str, tuple[int, float]] = {}
        for kv in found:
            name = kv.key[len(self._beats_prefix) :].decode(errors="replace")
            try:
                count = int(self._codec.decode(kv.key, kv.value))
            except (EtcdValueRejectedError, ValueError):
                continue  # the codec logged why
            before = self._beats_seen.get(name)
            if before is not None and count < before[0]:
                log.warning("rendezvous_heartbeat_replayed", key=kv.key.decode(errors="replace"))
            newer = before is None or count > before[0]
            seen[name] = (count, now) if newer else before  # type: ignore[assignment]
        self._beats_seen = seen
        return {name: at for name, (_, at) in seen.items()}


def _parse_token(token: Token) -> int | None:
    if isinstance(token, bool):
        return None
    if isinstance(token, int):
        return token if token > 0 else None
    if isinstance(token, str | bytes) and token.isdigit() and int(token) > 0:
        return int(token)
    return None
