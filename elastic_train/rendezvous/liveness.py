"""Which nodes of a rendezvous are alive, judged on this agent's own monotonic clock.

torch prunes a node whose heartbeat time, written with *that node's* wall clock,
is older than ``keep_alive_interval x keep_alive_max_attempt`` by *the reader's*
wall clock. A node whose clock runs 10 s behind therefore looks dead to everyone,
and one that runs 10 s ahead sees everyone else as dead (and prunes them when it
writes the state). Here no timestamp written by another host is ever compared
with a clock: a node's heartbeat values are only compared with the values this
agent saw before, and the age of a sign of life is measured from the moment
*this* agent first saw it, with ``time.monotonic()``.

Signs of life of a node:

- its heartbeat time in the state changed (the value is opaque here);
- the signed counter in its heartbeat key grew (rule 3 of
  :mod:`elastic_train.rendezvous.rules`). A counter, not the key's
  ``mod_revision``: a replayed old value bumps the revision, never the counter;
- the round is idle (complete, nobody waiting) and the node is one of its
  participants: their clocks do not run then (rule 2), and start from the last
  idle moment this agent saw once somebody waits.

A node this agent has never seen gets a full expiry from when it first sees it.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Protocol

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

__all__ = ["BEAT_BUDGET", "HeartbeatKeys", "Liveness", "beat_period", "node_name"]

#: Heartbeats a second that all nodes of one rendezvous send together, at most: a
#: round of more nodes than this beats every ``nodes / BEAT_BUDGET`` seconds instead
#: of every ``keep_alive_interval`` (and is pruned after that times the attempts).
#: At K = 512 the 512 heartbeat puts a second were most of what etcd served while the
#: round formed. Up to 128 nodes at a 1 s interval nothing changes: torch's rule.
BEAT_BUDGET = 128


def beat_period(interval: float, nodes: int) -> float:
    """Seconds between a node's heartbeats in a rendezvous of ``nodes`` nodes: ``interval``
    up to :data:`BEAT_BUDGET` nodes whatever the interval (small jobs keep torch's rule)."""
    return interval if nodes <= BEAT_BUDGET else max(interval, nodes / BEAT_BUDGET)


class HeartbeatKeys(Protocol):
    """One key per node holding its heartbeat counter (rule 3)."""

    def beat(self, node: str) -> None:
        """Advance ``node``'s counter."""

    def heartbeats(self) -> dict[str, float]:
        """Per node (by :func:`node_name`): the ``time.monotonic()`` of this process at which
        it first saw the node's current counter."""


def node_name(node: _NodeDesc) -> str:
    return f"{node.addr}_{node.pid}_{node.local_id}"


class Liveness:
    """When this agent last saw each node of the state show a sign of life (module docstring).

    Args:
        expiry: seconds without a sign of life after which a node is dead
            (``keep_alive_interval x keep_alive_max_attempt``).
        interval: ``keep_alive_interval`` in seconds: live nodes beat this often.
        keys: the nodes' heartbeat keys.
    """

    def __init__(self, *, expiry: float, interval: float, keys: HeartbeatKeys) -> None:
        self._expiry = expiry
        self._interval = interval
        self._keys = keys
        self._in_state: dict[_NodeDesc, tuple[object, float]] = {}  # value seen, first seen
        self._in_keys: dict[str, float] = {}
        self._keys_read_at = -math.inf
        self._first_read_at: float | None = None
        # The join folder prunes the states it folds from its own thread.
        self._lock = threading.Lock()

    def beat(self, node: _NodeDesc) -> None:
        """This agent's own heartbeat (rule 3): a sign of life it need not read back."""
        self._keys.beat(node_name(node))
        with self._lock:
            self._in_keys[node_name(node)] = time.monotonic()

    def dead(self, state: _RendezvousState, *, idle: bool) -> list[_NodeDesc]:
        """The nodes of ``state.last_heartbeats`` with no sign of life for ``expiry`` seconds.

        Reads the heartbeat keys only when some node is within one interval of
        expiring on what is known, and at most twice per interval: while training
        runs (an idle round) nobody reads them.
        """
        with self._lock:
            return self._dead(state, idle=idle)

    def observe(self, state: _RendezvousState) -> None:
        """Note the signs of life in a forming ``state`` without judging anyone (no read).

        Above ``BEAT_BUDGET`` nodes a forming round is judged by its join folder alone:
        every agent also reading the digest twice per period was K x K counters a
        period, and each pruned what its own late reads made look dead.
        """
        with self._lock:
            self._observe(state, idle=False, now=time.monotonic())

    def unprimed_for(self, nodes: int) -> float:
        """Seconds until this agent has read the heartbeat keys for one expiry (it starts
        reading now if it never did): before that it cannot tell a dead node from one it
        has just met. For an agent about to complete a large round in the folder's place."""
        with self._lock:
            now = time.monotonic()
            if self._first_read_at is None:
                self._read_keys(now)
            first = now if self._first_read_at is None else self._first_read_at
            return max(0.0, first + self._scaled(nodes)[1] - now)

    def _read_keys(self, now: float) -> None:
        for name, at in self._keys.heartbeats().items():
            self._in_keys[name] = max(at, self._in_keys.get(name, -math.inf))
            self._keys_read_at = now
        if self._first_read_at is None:
            self._first_read_at = now

    def _scaled(self, nodes: int) -> tuple[float, float]:
        """The interval the ``nodes`` nodes beat at, and the expiry: the configured ones
        up to BEAT_BUDGET nodes; above, the expiry keeps its number of missed beats."""
        interval = beat_period(self._interval, nodes)
        return interval, self._expiry * (interval / self._interval if nodes > BEAT_BUDGET else 1)

    def _dead(self, state: _RendezvousState, *, idle: bool) -> list[_NodeDesc]:
        now = time.monotonic()
        self._observe(state, idle=idle, now=now)
        nodes = list(state.last_heartbeats)
        interval, expiry = self._scaled(len(nodes))
        closing = any(self._age(node, now) >= expiry - interval for node in nodes)
        if closing and now - self._keys_read_at >= interval / 2:
            self._read_keys(now)
        return [node for node in nodes if self._age(node, now) > expiry]

    def _observe(self, state: _RendezvousState, *, idle: bool, now: float) -> None:
        seen: dict[_NodeDesc, tuple[object, float]] = {}
        for node, value in state.last_heartbeats.items():
            before = self._in_state.get(node)
            resting = idle and node in state.participants
            if before is None or before[0] != value or resting:
                seen[node] = (value, now)
            else:
                seen[node] = before
        self._in_state = seen
        names = {node_name(node) for node in seen}
        self._in_keys = {name: at for name, at in self._in_keys.items() if name in names}

    def _age(self, node: _NodeDesc, now: float) -> float:
        last = max(self._in_state[node][1], self._in_keys.get(node_name(node), -math.inf))
        return now - last
