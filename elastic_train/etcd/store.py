"""``EtcdV3Store``: a ``torch.distributed.Store`` kept in etcd v3.

torchrun's agent uses the rendezvous store for the master address and port, the
worker rank assignment and its exit barrier. Blocking reads wait on an etcd
watch (started at the revision of the read that missed, so no write is lost),
never on a sleep loop. Every key lives under a per-run prefix and, with
``lease_ttl``, under a lease, so an abandoned run's keys expire on their own.

Every value is framed by the job's :class:`~elastic_train.etcd.codec.ValueCodec`
on write and checked on every read (``get``, ``wait``, ``compare_set``, ``add``),
keyed by the full etcd key: a forged value, or one copied from another key or
run, raises :class:`~elastic_train.errors.EtcdValueRejectedError` naming the key.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from elastic_train.etcd.client import EtcdClient, KeyValue
from elastic_train.etcd.codec import ValueCodec, read_verified
from elastic_train.etcd.sync import LeaseKeeper

T = TypeVar("T")

DEFAULT_TIMEOUT = timedelta(seconds=300)
# A watch that outlives this is re-armed after a fresh read, which also moves
# the wait to another member when the watched one went silent.
_WATCH_SLICE_S = 10.0


def _to_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdV3Store(dist.Store):
    """A c10d store on etcd v3 under ``prefix`` whose values ``codec`` frames and checks."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        *,
        codec: ValueCodec,
        timeout: timedelta = DEFAULT_TIMEOUT,
        lease_ttl: int | None = None,
    ) -> None:
        super().__init__()  # the pybind trampoline needs it
        if not prefix:
            raise ValueError("prefix must be a non-empty string")
        self._client = client
        self._codec = codec
        self._prefix = prefix.rstrip("/").encode() + b"/"
        self._lease = LeaseKeeper(client, lease_ttl) if lease_ttl else None
        self.set_timeout(timeout)

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix + _to_bytes(key)

    def _lease_run(self, write: Callable[[int], T]) -> T:
        return self._lease.run(write) if self._lease else write(0)

    def _verified(self, full: bytes, value: KeyValue | None) -> tuple[bytes, KeyValue] | None:
        return read_verified(self._codec, full, value, lambda: self._client.get(full)[0])

    def set(self, key: str, value: str | bytes) -> None:
        full = self._key(key)
        data = self._codec.encode(full, _to_bytes(value))
        self._lease_run(lambda lease: self._client.put(full, data, lease=lease))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store timeout for it to be set."""
        return self._wait_for([key], self.timeout)[0]

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the decimal integer at ``key`` (absent: 0)."""
        full = self._key(key)
        current = self._verified(full, self._client.get(full)[0])
        while True:
            value = int(current[0]) + amount if current else amount
            written, raw, _ = self._lease_run(
                lambda lease, c=current, v=value: self._client.put_if_revision(
                    full,
                    self._codec.encode(full, str(v).encode()),
                    mod_revision=c[1].mod_revision if c else 0,
                    lease=lease,
                )
            )
            if written:
                return value
            current = self._verified(full, raw)

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Set ``desired`` if the key holds ``expected`` (or is absent and ``expected`` is
        empty); return the value the key holds afterwards, as ``TCPStore`` does."""
        full, expected, desired = (
            self._key(key),
            _to_bytes(expected_value),
            _to_bytes(desired_value),
        )
        # HMAC and digest are deterministic, so the framed expected value is the
        # exact bytes etcd holds when the key holds ``expected``.
        written, current, _ = self._lease_run(
            lambda lease: self._client.put_if_value(
                full,
                self._codec.encode(full, desired),
                expected=self._codec.encode(full, expected) if expected else None,
                lease=lease,
            )
        )
        if written:
            return desired
        verified = self._verified(full, current)
        if verified is None:  # absent, and a non-empty value was expected
            return expected
        return verified[0]

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key is set now (no waiting)."""
        return all(self._client.get(self._key(key))[0] is not None for key in keys)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Block until every key is set, or raise ``DistStoreError`` after the timeout."""
        self._wait_for(keys, self.timeout if timeout is None else timeout)

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key))

    def num_keys(self) -> int:
        return self._client.get_prefix(self._prefix, count_only=True)[1]

    # c10d's C++ wrappers (PrefixStore) look these two up by their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys

    def _wait_for(self, keys: Sequence[str], timeout: timedelta) -> list[bytes]:
        """Each key's checked value, once all are set; refused ones raise at once."""
        deadline = time.monotonic() + timeout.total_seconds()
        found: dict[str, bytes] = {}
        while True:
            missing, revision = None, 0
            for key in keys:
                if key not in found:
                    value, revision = self._client.get(self._key(key))
                    verified = self._verified(self._key(key), value)
                    if verified is None:
                        missing = key
                        break
                    found[key] = verified[0]
            if missing is None:
                return [found[key] for key in keys]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise dist.DistStoreError(
                    f"timed out after {timeout.total_seconds():g}s waiting for key {missing!r} "
                    f"under {self._prefix.decode(errors='replace')!r} in etcd at "
                    f"{self._client.endpoints}"
                )
            # Watch from just after the read that missed, so no write slips through.
            self._client.watch_once(
                self._key(missing),
                prefix=False,
                start_revision=revision + 1,
                timeout=min(remaining, _WATCH_SLICE_S),
            )
