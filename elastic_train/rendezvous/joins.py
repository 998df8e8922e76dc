"""Batched joins: each joining agent writes its own request key, and one elected agent
folds every pending request into the state with one compare-and-swap per batch.

torch's handler has every joining agent read the one state key, add itself and
write the whole state back by compare-and-swap. All K agents of a round write
that key at once, so each success makes the other writers lose and retry: about
K^2 / 2 attempts a round (2 300 lost writes at K = 128, 13.6 s). Here:

- A node whose join step (torch's ``_RendezvousJoinOp``) says *add me* (to the
  participants, the wait list or the redundancy list) puts its own key
  ``{run}/joins/{node}`` instead (:class:`JoinRequester`): a put of a key nobody
  else writes, which never conflicts. The value, signed and bound to its key
  like every value, names the node and the round it asked in.
- The agents inside ``next_rendezvous`` elect a folder: the one that creates
  ``{run}/leader`` under a short lease (``keep_alive_interval x
  keep_alive_max_attempt``, renewed by the folder). The folder watches the
  request keys and folds a batch of them (at most :data:`MAX_BATCH`, etcd's
  ``--max-txn-ops`` is 128) into the state in ONE transaction that also deletes
  the requests it consumed, and only if neither the state nor any of those
  requests changed since it read them. For each request it runs torch's own
  join step for that node on the state and applies torch's own action, so
  min/max nodes, last call, the wait and redundancy lists and closing keep
  torch's meaning. The others wait on the state watch they already have.
- A folder that dies stops renewing its lease; etcd deletes the leader key after
  the lease's ttl and the waiting agents' folders take over.

Leadership only avoids conflicts, it is not what makes the fold safe: two folders
at once (a lease that expired under a slow one) still each write with a
compare-and-swap on the state and on every request they consume.
"""

from __future__ import annotations

import json
import math
import pickle
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol

from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousGracefulExitError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    _Action,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousJoinOp,
    _RendezvousState,
)

from elastic_train.errors import EtcdError, EtcdValueRejectedError
from elastic_train.etcd.client import EtcdClient, KeyValue, LeaseExpiredError
from elastic_train.etcd.codec import ValueCodec
from elastic_train.log import get_logger
from elastic_train.rendezvous.liveness import beat_period, node_name

__all__ = [
    "JOIN_ACTIONS",
    "MAX_BATCH",
    "BatchFold",
    "FoldTarget",
    "JoinFolder",
    "JoinKeys",
    "JoinRequester",
    "RequestStore",
    "fold",
]

log = get_logger(__name__)

#: The join steps an agent asks the folder for instead of writing the state itself.
JOIN_ACTIONS = frozenset(
    {_Action.ADD_TO_PARTICIPANTS, _Action.ADD_TO_WAIT_LIST, _Action.ADD_TO_REDUNDANCY_LIST}
)
#: Requests per transaction: 1 + this many compares and operations, under etcd's 128.
MAX_BATCH = 100
#: A request older than this many rounds is from an agent that is gone: dropped, not applied.
_STALE_ROUNDS = 2


@dataclass(frozen=True)
class JoinKeys:
    """Where the requests and the leader key live, and how their values are signed."""

    client: EtcdClient
    codec: ValueCodec
    requests: bytes  # prefix: {run}/joins/
    leader: bytes  # {run}/leader
    lease_ttl: int  # seconds a silent folder keeps the leader key (up to BEAT_BUDGET nodes)
    beats: bytes = b""  # prefix of the heartbeat keys: with the requests, how many nodes


def _request_key(keys: JoinKeys, node: _NodeDesc) -> bytes:
    return keys.requests + node_name(node).encode()


class RequestStore(Protocol):
    """Writes of one agent's own request key; failures raise torch's rendezvous errors."""

    def put_leased(self, key: bytes, value: bytes) -> None:
        """Put under the run's lease, so an abandoned request expires with the run."""

    def exists(self, key: bytes) -> bool: ...

    def remove(self, key: bytes) -> None: ...

    def join_requests(self) -> tuple[list[KeyValue], int]:
        """Every request key, oldest first, and the store revision of the read."""


class JoinRequester:
    """This agent's request key: posted when its join step says *add me*, withdrawn after."""

    def __init__(self, keys: JoinKeys, node: _NodeDesc, *, store: RequestStore) -> None:
        self._keys = keys
        self._node = node
        self._key = _request_key(keys, node)
        self._store = store
        self._posted_at: int | None = None  # state revision seen when the request was posted

    def request(self, state: _RendezvousState, *, token: int) -> None:
        """Make sure a request is pending while the state (at revision ``token``) lacks us.

        Posted once; re-posted only if the state changed since and our key is gone
        (consumed by a fold that could not add us, or dropped as stale). The look-up is
        not rate-limited, at any size: a node that a fold put on the wait list must ask
        again as soon as the round reopens, or the round forms without it (a look-up
        every 1.5 s cost an extra restart per join in the two-node warm-start test).
        """
        if self._posted_at is not None:
            if token == self._posted_at:
                return  # nothing changed since we asked: still pending
            self._posted_at = token
            if self._store.exists(self._key):
                return
        payload = {
            "addr": self._node.addr,
            "pid": self._node.pid,
            "local_id": self._node.local_id,
            "round": state.round,
        }
        value = self._keys.codec.encode(self._key, json.dumps(payload).encode())
        self._store.put_leased(self._key, value)
        self._posted_at = token

    def others_pending(self, state: _RendezvousState) -> bool:
        """Whether another node's valid request is pending that a fold of ``state`` would
        apply: the round must not be completed without it (one read, only when the folder
        has not completed a round in time)."""
        found, _ = self._store.join_requests()
        for kv in found:
            request = parse_request(self._keys, kv)
            if request is None or request[0] == self._node or request[0] in state.participants:
                continue
            if request[1] >= state.round - _STALE_ROUNDS:
                return True
        return False

    def withdraw(self) -> None:
        """Delete our request, if we posted one (the join loop ended)."""
        if self._posted_at is not None:
            self._posted_at = None
            self._store.remove(self._key)


def parse_request(keys: JoinKeys, kv: KeyValue) -> tuple[_NodeDesc, int] | None:
    """The node and round of a request, or None if refused (bad MAC, malformed, misplaced)."""
    try:
        data = json.loads(keys.codec.decode(kv.key, kv.value))
        node = _NodeDesc(str(data["addr"]), int(data["pid"]), int(data["local_id"]))
        asked_round = int(data["round"])
    except EtcdValueRejectedError:
        return None  # the codec logged why
    except (ValueError, KeyError, TypeError):
        log.warning("rendezvous_join_request_malformed", key=kv.key.decode(errors="replace"))
        return None
    if kv.key != _request_key(keys, node):
        log.warning("rendezvous_join_request_misplaced", key=kv.key.decode(errors="replace"))
        return None
    return node, asked_round


def fold(
    state: _RendezvousState,
    requests: list[tuple[_NodeDesc, int]],
    settings: RendezvousSettings,
    *,
    apply: Callable[[_NodeDesc, _RendezvousState, _Action], None],
) -> int:
    """Apply torch's join step of each requesting node to ``state``; how many were applied.

    A request for a closed rendezvous, or one that the state already satisfies,
    changes nothing; its node sees the state itself and acts (closed: it stops).
    """
    applied = 0
    for node, asked_round in requests:
        if asked_round < state.round - _STALE_ROUNDS:
            log.info("rendezvous_join_request_stale", node=node_name(node), round=asked_round)
            continue
        try:
            action = _RendezvousJoinOp()(_RendezvousContext(node, state, settings), math.inf)
        except RendezvousGracefulExitError:
            continue  # closed while it waited as a spare: it stops on its own
        if action in JOIN_ACTIONS:
            apply(node, state, action)
            applied += 1
    return applied


class JoinFolder:
    """The folding duty of one agent while it is inside ``next_rendezvous``.

    An agent whose join request is pending offers to lead (:meth:`offer_to_lead`,
    called from its join loop, at most every ``lease_ttl / 2``): if nobody holds the
    leader key it takes it and starts folding in a daemon thread, until its join
    is over (:meth:`stop`) or it loses the key. Agents that do not lead keep no
    thread and no watch of their own, which matters at K = 512.

    Args:
        keys: the keys and codec.
        node: this agent (written into the leader key, for people reading etcd).
        fold_batch: reads the pending requests and the state, folds, writes; returns
            the store revision of its read of the requests, or None after a lost write.
        wake_every: longest sleep of a leading folder, and how often it publishes the
            heartbeat digest.
        publish_beats: writes the digest of all heartbeat counters under a lease.
    """

    def __init__(
        self,
        keys: JoinKeys,
        node: _NodeDesc,
        *,
        fold_batch: Callable[[], int | None],
        wake_every: float = 0.5,
        wake_in: Callable[[], float] = lambda: math.inf,
        publish_beats: Callable[[int], int] = lambda lease: 0,
    ) -> None:
        self._publish_beats = publish_beats
        self._published = -math.inf
        self._publish_every = wake_every
        self._wake_in = wake_in
        self._keys = keys
        self._name = node_name(node).encode()
        self._fold_batch = fold_batch
        self._wake_every = wake_every
        self._lease = 0
        self._ttl = keys.lease_ttl  # of the leader lease granted last
        self._leading = False
        self._renewed = 0.0
        self._offered = -math.inf
        self._token = -1  # the state revision last seen by offer_to_lead
        self._moved = -math.inf  # monotonic: when that revision changed
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    @property
    def leading(self) -> bool:
        return self._leading

    def offer_to_lead(self, token: int = 0, scaled: bool = False) -> None:
        """Take the leader key if it is free (rate-limited): start folding if so.

        ``token``: the state revision this agent sees; ``scaled``: the state has more
        nodes than ``liveness.BEAT_BUDGET``. Then, while the state moves (a folder is
        at work), the key is looked at only every ``2 x lease_ttl``, as a safety net;
        once the state has been still for ``lease_ttl / 2``, every ``lease_ttl / 2`` as
        in smaller rounds. At K = 512 every pending agent reading the leader key every
        1.5 s was 340 reads a second.
        """
        with self._lock:
            now = time.monotonic()
            if self._leading or self._stopped.is_set():
                return
            if token != self._token:
                self._token, self._moved = token, now
            quiet = now - self._moved >= self._keys.lease_ttl / 2
            every = self._keys.lease_ttl / 2 if quiet or not scaled else 2 * self._keys.lease_ttl
            if now - self._offered < every:
                return
            self._offered = now
            if self._keys.client.get(self._keys.leader)[0] is not None or not self._take():
                return
            self._leading = True
        log.info("rendezvous_join_folder_elected", node=self._name.decode())
        threading.Thread(target=self._run, name="rdzv-join-folder", daemon=True).start()

    def stop(self, *, release: bool = True) -> None:
        """Stop folding; ``release``: give the leader key up now (else its lease expires)."""
        with self._lock:
            self._stopped.set()
            lease, self._lease, self._leading = self._lease, 0, False
        if release and lease:
            try:
                self._keys.client.revoke_lease(lease)
            except EtcdError as exc:  # it expires by itself within lease_ttl
                log.debug("rendezvous_leader_release_failed", error=str(exc))

    def _run(self) -> None:
        interval = min(self._ttl / 3, self._wake_every)
        while not self._stopped.is_set() and self._leading:
            try:
                self._renew()
                self._publish_if_due()
                revision = self._fold_pending()
                if revision is not None and not self._stopped.is_set():
                    self._keys.client.watch_once(
                        self._keys.requests,
                        prefix=True,
                        start_revision=revision + 1,
                        timeout=min(interval, self._wake_in() + 0.005),
                    )
            except (EtcdError, RendezvousError) as exc:  # an outage: the join loop decides
                log.warning("rendezvous_join_folder_error", error=str(exc))
                self._stopped.wait(0.2)

    def _publish_if_due(self) -> None:
        """The digest of every heartbeat counter, under the leader's lease (it goes with us).

        Without it every agent that judges a node near expiry reads all K heartbeat
        keys itself, twice per interval: K x K reads, which at K = 256 starved the
        simulator into pruning live nodes. With it each reads one key.
        """
        if time.monotonic() - self._published < self._publish_every:
            return
        self._published = time.monotonic()
        with self._lock:
            lease = self._lease
        if lease:
            nodes = self._publish_beats(lease)
            # Twice per heartbeat period, which grows above liveness.BEAT_BUDGET nodes:
            # reading K keys twice a second was most of a starved folder's work at K = 512.
            self._publish_every = beat_period(2 * self._wake_every, nodes) / 2

    def _renew(self) -> None:
        if time.monotonic() - self._renewed >= self._ttl / 3:
            with self._lock:
                lease = self._lease
            alive = bool(lease) and self._keys.client.refresh_lease(lease) > 0
            self._renewed = time.monotonic()
            if not alive:
                self._leading = False  # another agent may lead now; this thread ends

    def _fold_pending(self) -> int | None:
        """Fold until no request is pending; the revision of the last read, None if stopped."""
        while not self._stopped.is_set():
            revision = self._fold_batch()
            if revision is not None:
                return revision
            self._stopped.wait(random.uniform(0, 0.01))  # lost to another writer: re-read
            self._renew()  # a run of lost writes on a starved box can outlast the lease:
            if not self._leading:  # then another agent leads, and two folders only conflict
                return None
        return None

    def _leader_ttl(self) -> int:
        """``lease_ttl``, scaled like the heartbeat expiry above ``liveness.BEAT_BUDGET``
        nodes (the request and heartbeat keys): at K = 512 one fold cycle outlasted 3 s
        on the 2-core box, and the folders lost their leases one after another."""
        prefixes = [p for p in (self._keys.requests, self._keys.beats) if p]
        nodes = sum(self._keys.client.get_prefix(p, count_only=True)[1] for p in prefixes)
        return math.ceil(self._keys.lease_ttl * beat_period(1.0, nodes))

    def _take(self) -> bool:
        key = self._keys.leader
        value = self._keys.codec.encode(key, self._name)
        for _ in range(2):
            if not self._lease:
                self._ttl = self._leader_ttl()
                self._lease = self._keys.client.grant_lease(self._ttl)
            try:
                written, _, _ = self._keys.client.put_if_value(
                    key, value, expected=None, lease=self._lease
                )
            except LeaseExpiredError:
                self._lease = 0
                continue
            self._renewed = time.monotonic()
            return written
        return False


def load_state(payload: bytes | None) -> _RendezvousState:
    """torch's state from its (already verified) pickle; a fresh one for an absent key."""
    return _RendezvousState() if payload is None else pickle.loads(payload)


class FoldTarget(Protocol):
    """What one fold needs of the backend (``rendezvous.keys.EtcdV3RendezvousBackend``)."""

    def join_requests(self) -> tuple[list[KeyValue], int]:
        """Every request key, oldest first, and the store revision of the read."""

    def read_fresh(self) -> tuple[bytes | None, int]:
        """The verified state payload straight from etcd and its mod_revision (0: absent)."""

    def write_folded(self, state: bytes, *, token: int, consumed: list[tuple[bytes, int]]) -> bool:
        """Write ``state`` and delete ``consumed`` if none of them changed: one transaction."""


class BatchFold:
    """One fold of at most :data:`MAX_BATCH` pending requests (the folder's ``fold_batch``).

    Args:
        keys: the request keys and their codec.
        backend: reads and writes the state and the requests.
        settings: the rendezvous settings (min/max nodes, last call).
        prune: removes the nodes this agent judges dead from a state (its liveness).
        apply: applies torch's action for a node to a state (torch's executor).
    """

    def __init__(
        self,
        keys: JoinKeys,
        backend: FoldTarget,
        settings: RendezvousSettings,
        *,
        prune: Callable[[_RendezvousState], None],
        apply: Callable[[_NodeDesc, _RendezvousState, _Action], None],
    ) -> None:
        self._keys = keys
        self._backend = backend
        self._settings = settings
        self._prune = prune
        self._apply = apply
        self._refused: set[tuple[bytes, int]] = set()  # logged once, then skipped
        self._deadline_at = math.inf  # monotonic: when the forming round's last call ends

    def __call__(self) -> int | None:
        """One fold; the store revision of the read of the requests, or None to fold again
        at once (a lost write, or more requests pending than one batch holds)."""
        found, revision = self._backend.join_requests()
        batch: list[tuple[KeyValue, tuple[_NodeDesc, int]]] = []
        more = False  # requests left for the next batch
        for kv in found:
            if (kv.key, kv.mod_revision) in self._refused:
                continue
            if len(batch) == MAX_BATCH:
                more = True
                break
            request = parse_request(self._keys, kv)
            if request is None:
                self._refused.add((kv.key, kv.mod_revision))
                continue
            batch.append((kv, request))
        if not (batch or time.monotonic() >= self._deadline_at):
            return revision
        payload, token = self._backend.read_fresh()
        state = load_state(payload)
        self._prune(state)
        applied = fold(state, [r for _, r in batch], self._settings, apply=self._apply)
        # Never completed before every request pending at its last call is folded in.
        completed = not more and self._complete_if_due(state)
        if not (batch or completed):
            return revision
        consumed = [(kv.key, kv.mod_revision) for kv, _ in batch]
        if not self._backend.write_folded(pickle.dumps(state), token=token, consumed=consumed):
            return None
        log.debug("rendezvous_joins_folded", requests=len(batch), applied=applied)
        return None if more else revision

    @property
    def wake_in(self) -> float:
        """Seconds until the folder should look again even if no request comes (last call)."""
        return max(0.0, self._deadline_at - time.monotonic())

    def _complete_if_due(self, state: _RendezvousState) -> bool:
        """torch's completion at the end of the last call, done here once for everyone:
        otherwise every participant wakes at the deadline and races to write it."""
        self._deadline_at = math.inf
        if state.complete or state.deadline is None or not state.participants:
            return False
        left = (state.deadline - datetime.now(timezone.utc)).total_seconds()
        if left > 0:
            self._deadline_at = time.monotonic() + left
            return False
        if not self._settings.min_nodes <= len(state.participants) <= self._settings.max_nodes:
            return False
        self._apply(min(state.participants), state, _Action.MARK_RENDEZVOUS_COMPLETE)
        return True
