"""``EtcdV3RendezvousBackend``: torch's rendezvous state in one etcd key, one
heartbeat key and one join-request key per node beside it (the requests are
folded into the state by :mod:`elastic_train.rendezvous.joins`), every value
framed and checked by the job's :class:`~elastic_train.etcd.codec.ValueCodec`.
"""

from __future__ import annotations

import json
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
from elastic_train.rendezvous.joins import JoinKeys

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
        joins: str = "",
        leader: str = "",
        beats_digest: str = "",
        ttl: int = 7200,
        codec: ValueCodec,
        run_prefix: str = "",
    ) -> None:
        self._client = client
        self.run_prefix = run_prefix
        self._name = name
        self._key = key.encode()
        self._beats_prefix = heartbeats.encode()
        self._joins_prefix = joins.encode()
        self._leader_key = leader.encode()
        self._digest_key = beats_digest.encode()
        # Compare-and-swaps on the state key, counted for the benchmark and the tests
        # (their number per round is what batched joins bring from O(K^2) to O(K)).
        self.cas_attempts = 0
        self.cas_conflicts = 0
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

    @property
    def client(self) -> EtcdClient:
        return self._client

    @property
    def codec(self) -> ValueCodec:
        return self._codec

    def close(self) -> None:
        """Stop watching the state key (reads still work, straight from etcd)."""
        self._state.close()
        self._lease.stop_renewing()

    def get_state(self) -> tuple[bytes, Token] | None:
        value, revision = self._etcd(self._state.read_with_revision)
        verified = self._verified(value)
        if verified is None:
            # No state yet (the join folder writes the first one): wait for that, not spin.
            self._seen_revision = revision if value is None else 0
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

    def unchanged_since(self, token: int) -> bool:
        """Whether the watched state is known, without a request, to still be at ``token``."""
        value, fresh = self._state.peek()
        return fresh and value is not None and value.mod_revision == token

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
        self._count_cas(written)
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

    def _count_cas(self, written: bool) -> None:
        self.cas_attempts += 1  # a lost update of a counter only skews a benchmark
        self.cas_conflicts += int(not written)

    # -- batched joins (elastic_train.rendezvous.joins) ---------------------------------

    def join_keys(self, *, lease_ttl: int) -> JoinKeys | None:
        """The keys of batched joins (None if this backend was made without them)."""
        if not (self._joins_prefix and self._leader_key):
            return None
        return JoinKeys(
            client=self._client,
            codec=self._codec,
            requests=self._joins_prefix,
            leader=self._leader_key,
            lease_ttl=lease_ttl,
            beats=self._beats_prefix,
        )

    def put_leased(self, key: bytes, value: bytes) -> None:
        """Put a value under the run's lease (a join request)."""
        self._etcd(lambda: self._lease.run(lambda lease: self._client.put(key, value, lease=lease)))

    def exists(self, key: bytes) -> bool:
        return self._etcd(lambda: self._client.get(key))[0] is not None

    def remove(self, key: bytes) -> None:
        self._etcd(lambda: self._client.delete(key))

    def join_requests(self) -> tuple[list[KeyValue], int]:
        """Every join request key, oldest first, and the store revision of the read."""
        found, revision = self._etcd(lambda: self._client.get_prefix(self._joins_prefix))
        return sorted(found, key=lambda kv: kv.mod_revision), revision

    def read_fresh(self) -> tuple[bytes | None, int]:
        """The verified state payload straight from etcd and its mod_revision (0: absent)."""
        verified = self._verified(self._etcd(lambda: self._client.get(self._key)[0]))
        return (None, 0) if verified is None else (verified[0], verified[1].mod_revision)

    def write_folded(self, state: bytes, *, token: int, consumed: list[tuple[bytes, int]]) -> bool:
        """Write ``state`` if it is still at ``token`` and delete the ``consumed`` requests if
        they are still at their revisions: one transaction, all or nothing."""
        encoded = self._codec.encode(self._key, state)
        written, revision = self._etcd(
            lambda: self._lease.run(
                lambda lease: self._client.put_and_delete_if_revisions(
                    expected=[(self._key, token), *consumed],
                    put=(self._key, encoded, lease),
                    deletes=[key for key, _ in consumed],
                )
            )
        )
        self._count_cas(written)
        if written:
            self._state.offer(KeyValue(self._key, encoded, revision))
        return written

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
        no sign of life: the node just looks older. The counters come from the
        join folder's digest while one publishes it, else from every node's key.
        """
        counts = self._digest_counts()
        from_keys = counts is None
        if counts is None:
            counts = self.heartbeat_counts()
        now = time.monotonic()
        seen: dict[str, tuple[int, float]] = {}
        for name, count in counts.items():
            before = self._beats_seen.get(name)
            # A digest may lag the keys read before it (it is written every period / 2):
            # only a key's own value going back is a replay worth a warning.
            if before is not None and count < before[0] and from_keys:
                key = (self._beats_prefix + name.encode()).decode(errors="replace")
                log.warning("rendezvous_heartbeat_replayed", key=key)
            newer = before is None or count > before[0]
            seen[name] = (count, now) if newer else before  # type: ignore[assignment]
        self._beats_seen = seen
        return {name: at for name, (_, at) in seen.items()}

    def heartbeat_counts(self) -> dict[str, int]:
        """Every node's verified heartbeat counter, read from the nodes' own keys."""
        found, _ = self._etcd(lambda: self._client.get_prefix(self._beats_prefix))
        counts: dict[str, int] = {}
        for kv in found:
            try:
                count = int(self._codec.decode(kv.key, kv.value))
            except (EtcdValueRejectedError, ValueError):
                continue  # the codec logged why
            counts[kv.key[len(self._beats_prefix) :].decode(errors="replace")] = count
        return counts

    def publish_beats(self, *, lease: int) -> int:
        """Write the digest of every counter (the join folder, under its leader lease);
        how many nodes it holds."""
        if not self._digest_key:
            return 0
        counts = self.heartbeat_counts()
        value = self._codec.encode(self._digest_key, json.dumps(counts).encode())
        self._etcd(lambda: self._client.put(self._digest_key, value, lease=lease))
        return len(counts)

    def _digest_counts(self) -> dict[str, int] | None:
        if not self._digest_key:
            return None
        kv, _ = self._etcd(lambda: self._client.get(self._digest_key))
        if kv is None:
            return None  # no folder publishes it now: read the keys
        try:
            counts = json.loads(self._codec.decode(kv.key, kv.value))
            return {str(name): int(count) for name, count in counts.items()}
        except (EtcdValueRejectedError, ValueError, TypeError, AttributeError):
            return None  # refused (the codec logged why): read the keys


def _parse_token(token: Token) -> int | None:
    if isinstance(token, bool):
        return None
    if isinstance(token, int):
        return token if token > 0 else None
    if isinstance(token, str | bytes) and token.isdigit() and int(token) > 0:
        return int(token)
    return None
