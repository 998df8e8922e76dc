"""Keeping etcd keys alive and local copies of them current, on top of :mod:`etcd_client`.

- :class:`LeaseKeeper`: one lease per writer, renewed on write, so abandoned keys expire.
- :class:`WatchedKey`: a local copy of one key, kept current by a watch, so a reader
  that polls (torch's rendezvous handler, about once a second per agent) costs etcd
  nothing between changes.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

from elastic_train import metrics
from elastic_train.errors import EtcdError
from elastic_train.etcd.client import EtcdClient, KeyValue, LeaseExpiredError, WatchEvent
from elastic_train.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")


class LeaseKeeper:
    """One lease per writer, renewed on use once 1% of its TTL has passed.

    A key written with :meth:`run` therefore lives at least 99% of ``ttl`` after
    its last write, at a cost of one extra request per ``ttl / 100`` seconds.
    """

    def __init__(self, client: EtcdClient, ttl: int) -> None:
        if ttl < 1:
            raise ValueError(f"ttl={ttl!r} must be a positive number of seconds")
        self._client = client
        self._ttl = ttl
        self._lock = threading.Lock()
        self._lease_id = 0
        self._renewed = 0.0
        self._stopped = threading.Event()

    def renew_in_background(self) -> None:
        """Also renew the lease every ``ttl / 4`` in a daemon thread, until :meth:`stop_renewing`.

        For writers that may go quiet for longer than ``ttl`` while their keys must stay.
        """
        thread = threading.Thread(target=self._renew_loop, name="etcd-lease-renewal", daemon=True)
        thread.start()

    def stop_renewing(self) -> None:
        self._stopped.set()

    def _renew_loop(self) -> None:
        while not self._stopped.wait(self._ttl / 4):
            with self._lock:
                lease_id = self._lease_id
            if not lease_id:
                continue
            try:
                ttl_left = self._client.refresh_lease(lease_id)
            except EtcdError as exc:
                # Keys expire when no renewal succeeds for a whole ttl: worth a warning
                # (and a counter) long before that, not a debug line.
                metrics.etcd_lease_renewal_failed()
                log.warning("lease_renewal_failed", lease=lease_id, ttl=self._ttl, error=str(exc))
                continue
            with self._lock:
                if ttl_left > 0:
                    self._renewed = time.monotonic()
                elif self._lease_id == lease_id:
                    self._lease_id = 0  # the next write takes a new lease
            if ttl_left <= 0:
                metrics.etcd_lease_renewal_failed()
                log.warning("lease_expired", lease=lease_id, ttl=self._ttl)

    def run(self, write: Callable[[int], T]) -> T:
        """Call ``write(lease_id)``; if the lease expired meanwhile, take a new one and retry."""
        try:
            return write(self._current())
        except LeaseExpiredError:
            with self._lock:
                self._lease_id = 0
            return write(self._current())

    def _current(self) -> int:
        with self._lock:
            now = time.monotonic()
            if self._lease_id and now - self._renewed < max(1.0, self._ttl / 100):
                return self._lease_id
            if not self._lease_id or self._client.refresh_lease(self._lease_id) <= 0:
                self._lease_id = self._client.grant_lease(self._ttl)
            self._renewed = now
            return self._lease_id


class WatchedKey:
    """A local copy of one etcd key, kept current by a watch in a daemon thread.

    :meth:`read` serves the copy while it is known fresh: the watch applies every
    change as it happens, and the key is re-read from etcd at least every
    ``refresh`` seconds, so a silently dead stream cannot keep a stale copy for
    longer. When the watch is broken, :meth:`read` goes to etcd.
    """

    def __init__(self, client: EtcdClient, key: bytes, *, refresh: float = 60.0) -> None:
        self._client = client
        self._key = key
        self._refresh = refresh
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._value: KeyValue | None = None
        self._revision = 0  # of the newest change applied to the copy
        self._fresh_until = 0.0
        self._closed = threading.Event()
        thread = threading.Thread(target=self._run, name="etcd-watched-key", daemon=True)
        thread.start()

    def read(self) -> KeyValue | None:
        with self._lock:
            if time.monotonic() < self._fresh_until:
                return self._value
        value, revision = self._client.get(self._key)
        self._offer(value, revision, fresh=False)
        return value

    def read_with_revision(self) -> tuple[KeyValue | None, int]:
        """:meth:`read`, and the revision the copy is current at (for an absent key too)."""
        with self._lock:
            if time.monotonic() < self._fresh_until:
                return self._value, self._revision
        value, revision = self._client.get(self._key)
        self._offer(value, revision, fresh=False)
        return value, revision

    def peek(self) -> tuple[KeyValue | None, bool]:
        """The local copy, and whether the watch vouches for it now (no request either way)."""
        with self._lock:
            return self._value, time.monotonic() < self._fresh_until

    def wait_newer(self, revision: int, timeout: float) -> bool:
        """Block until the copy is newer than ``revision`` (True) or ``timeout`` passed.

        While the watch is broken the copy may lag, so callers bound ``timeout``
        and re-read anyway.
        """
        with self._changed:
            return self._changed.wait_for(lambda: self._revision > revision, timeout)

    def offer(self, value: KeyValue) -> None:
        """Apply our own successful write right away (the watch would, a moment later)."""
        self._offer(value, value.mod_revision, fresh=False)

    def close(self) -> None:
        """Stop the watch; later reads go to etcd."""
        self._closed.set()
        with self._lock:
            self._fresh_until = 0.0

    def _offer(self, value: KeyValue | None, revision: int, *, fresh: bool) -> None:
        with self._lock:
            if revision >= self._revision:
                self._value, self._revision = value, revision
                self._changed.notify_all()
            if fresh and not self._closed.is_set():
                self._fresh_until = time.monotonic() + 1.5 * self._refresh

    def _apply(self, events: list[WatchEvent]) -> bool:
        for event in events:
            value = None if event.deleted else event.kv
            self._offer(value, event.kv.mod_revision, fresh=False)
        return self._closed.is_set()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                value, revision = self._client.get(self._key)
                self._offer(value, revision, fresh=True)
                outcome = self._client.watch(
                    self._key,
                    prefix=False,
                    start_revision=revision + 1,
                    timeout=self._refresh,
                    on_events=self._apply,
                )
            except EtcdError as exc:
                log.debug(
                    "watched_key_error", key=self._key.decode(errors="replace"), error=str(exc)
                )
                outcome = "broken"
            if outcome == "broken":
                with self._lock:
                    self._fresh_until = 0.0  # read() goes to etcd until the watch is back
                self._closed.wait(0.5)


def close_with(owner: object, watched: WatchedKey, lease: LeaseKeeper) -> None:
    """Stop the threads of ``watched`` and ``lease`` when ``owner`` is garbage-collected."""
    weakref.finalize(owner, watched.close)
    weakref.finalize(owner, lease.stop_renewing)
