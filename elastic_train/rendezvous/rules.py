"""The two rules in which our rendezvous departs from torch's dynamic rendezvous.

torch's ``DynamicRendezvousHandler`` keeps a completed round alive until every
participant has left it or been pruned for a stale heartbeat, and it polls the
shared state once a second. After a node dies, the survivors therefore wait
``keep_alive_interval x keep_alive_max_attempt`` for the dead node to be pruned,
then ``last_call_timeout``, each rounded up to the next 1 s poll; and every agent
rewrites the whole state once per ``keep_alive_interval`` while training runs.

The rules here:

1. **A participant that leaves a completed round ends it** (:class:`FastOpExecutor`).
   A node leaves its round only when its workers have stopped, and DDP cannot
   go on without them, so the round is over for everyone: the next round starts
   at once, without waiting for the dead node's heartbeat to expire. Agents whose
   workers have not failed yet see that their round ended
   (:func:`round_ended`) and restart, as for a joining node.
2. **Participants of a completed round heartbeat only while a node waits, or
   while the round settles** (:func:`keep_alive_while_awaited`,
   :class:`WatchedStateHolder`). While training runs and nobody waits, agents
   stay silent and nobody is pruned: rule 1 ends the round of a dead
   participant as soon as a survivor restarts. When a node starts waiting (to
   join, or as a spare), the participants' clocks start; live participants then
   heartbeat every ``keep_alive_interval``, and dead ones are pruned after
   ``keep_alive_interval x keep_alive_max_attempt`` as in torch. That is what
   lets a job whose nodes all died (no survivor to apply rule 1) restart.
   Waiting nodes and nodes joining an incomplete round heartbeat as in torch.
   A round *settles* from its completion until the agent's workers have formed
   their process group (:mod:`elastic_train.rendezvous.settling`): a node that
   dies then has no worker in a group for the survivors' collectives to fail
   on, so the survivors' workers would wait for it until their store timed
   out. Its participants' clocks run and its agents beat meanwhile, and **a
   participant pruned from a completed round ends the round** for everyone, as
   in rule 1: the survivors restart without it.
3. **A heartbeat is a put of the node's own key, not a write of the state**
   (:meth:`WatchedStateHolder.beat`). torch rewrites the one shared state for
   every heartbeat, by compare-and-swap, so K joining agents spend K writes a
   second on heartbeats alone and every one of them makes the others' joins
   retry; at K = 64 the joins starved. The keys are read only when some node
   is close to being pruned on what is known, so nobody reads them while
   training runs.

Who is alive is judged on each agent's own monotonic clock, never by comparing
another host's timestamp with this one's
(:class:`~elastic_train.rendezvous.liveness.Liveness`), so a skewed clock
evicts nobody.

Joins are batched (:mod:`elastic_train.rendezvous.joins`): a join step that would
add this node to the state is posted as a request key instead, and one elected
agent folds the pending requests into the state with one compare-and-swap per
batch (:meth:`FastOpExecutor._by_folder`).

And two mechanical changes: instead of sleeping 1 s whenever it has to wait,
the join loop wakes on the next change of the state key (the backend watches
it) or at the moment the last call ends; and torch's rendezvous events are
named without ``inspect.stack()``
(:func:`~elastic_train.rendezvous.events.record_event`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Protocol

from torch.distributed.elastic.events import NodeState
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    RendezvousSettings,
    _Action,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _remove_participant_epilogue,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousState,
)

from elastic_train.log import get_logger
from elastic_train.rendezvous.events import record_event
from elastic_train.rendezvous.joins import JOIN_ACTIONS, JoinRequester
from elastic_train.rendezvous.liveness import (
    BEAT_BUDGET,
    HeartbeatKeys,
    Liveness,
    beat_period,
    node_name,
)

__all__ = [
    "ChangeWaiter",
    "FastOpExecutor",
    "WatchedStateHolder",
    "awaited",
    "end_round",
    "keep_alive_while_awaited",
    "round_ended",
]

log = get_logger(__name__)

#: The longest the join loop waits without re-reading (torch's fixed poll).
_MAX_WAIT = 1.0
#: Seconds over which woken nodes spread their re-reads.
_WAKE_SPREAD = 0.02
#: Largest backoff after losing compare-and-swaps, seconds.
_MAX_BACKOFF = 0.2


def _backoff(conflicts: int) -> None:
    """Randomized, growing pause after ``conflicts`` lost compare-and-swaps in a row.

    All nodes of a round write the one state key; without a pause the losers
    retry in lock step and lose again (seen with 64 agents).
    """
    time.sleep(random.uniform(0, min(_MAX_BACKOFF, 0.005 * 2**conflicts)))


class ChangeWaiter(Protocol):
    def wait_for_change(self, timeout: float) -> bool:
        """Block until the state changed since it was last read, or ``timeout`` passed."""


def round_ended(state: _RendezvousState, node: _NodeDesc, joined_round: int | None) -> bool:
    """Whether the round ``node`` joined (``joined_round``) has ended under rule 1."""
    if joined_round is None:
        return False
    return state.round != joined_round or node not in state.participants


def awaited(state: _RendezvousState) -> bool:
    """Whether some node waits for a completed round: on the wait or the spare list."""
    return bool(state.wait_list or state.redundancy_list)


def keep_alive_while_awaited(
    ctx: _RendezvousContext,
    deadline: float,
    *,
    beat_due: Callable[[_NodeDesc], bool],
    settling: Callable[[_RendezvousState], bool] = lambda state: False,
) -> _Action:
    """The background heartbeat of a participant of a completed round (rule 2).

    ``beat_due`` judges on this agent's own clock: the state's timestamp of this
    node may have been written by the join folder, with another host's clock.
    ``settling``: whether the round still settles for this agent.
    """
    state = ctx.state
    if not (state.complete and ctx.node in state.participants):
        return _Action.FINISH
    if not (awaited(state) or settling(state)):
        return _Action.FINISH
    if not beat_due(ctx.node):
        return _Action.FINISH
    return _Action.ERROR_TIMEOUT if time.monotonic() > deadline else _Action.KEEP_ALIVE


class WatchedStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder, reading on every sync (the backend serves a watched
    copy, so a read costs etcd nothing) and pruning on this agent's own clock
    (:class:`~elastic_train.rendezvous.liveness.Liveness`, rules 2 and 3)."""

    def __init__(
        self, backend: RendezvousBackend, settings: RendezvousSettings, *, heartbeats: HeartbeatKeys
    ) -> None:
        super().__init__(backend, settings, cache_duration=0)
        interval = settings.keep_alive_interval.total_seconds()
        self._liveness = Liveness(
            expiry=interval * settings.keep_alive_max_attempt, interval=interval, keys=heartbeats
        )
        # Only this node's own clock ever judges whether its own heartbeat is due.
        self._own_beat: tuple[_NodeDesc, datetime] | None = None
        self._own_beat_at: dict[_NodeDesc, float] = {}  # monotonic
        # A pruned node stays in etcd until some node writes the state, and each
        # read prunes it again: log it once per round.
        self._reported_dead: set[_NodeDesc] = set()
        self._reported_round = -1
        #: Whether a completed round still settles for this agent (rule 2); set by the handler.
        self.settling: Callable[[_RendezvousState], bool] = lambda state: False

    def _idle(self, state: _RendezvousState) -> bool:
        """Rule 2: a completed round that nobody waits for and that has settled."""
        return state.complete and not awaited(state) and not self.settling(state)

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        record_event(self, run_id=self._settings.run_id, message=message, node_state=node_state)

    @property
    def token(self) -> int:
        """The mod_revision of the state last read or written (0: none yet)."""
        return self._token if isinstance(self._token, int) else 0

    def prune(self, state: _RendezvousState) -> bool:
        """Remove from ``state`` (read by the join folder) the nodes this agent judges dead;
        whether there were any."""
        dead = self._liveness.dead(state, idle=self._idle(state))
        _remove_nodes(state, dead, self._settings)
        return bool(dead)

    def unprimed_for(self) -> float:
        """Seconds until this agent can judge who is dead (it starts reading if it never did)."""
        return self._liveness.unprimed_for(len(self._state.last_heartbeats))

    def beat_due(self, node: _NodeDesc) -> bool:
        """Whether ``node`` (this agent's) last beat a keep-alive interval ago or never,
        on this agent's monotonic clock."""
        return self.beat_due_in(node) <= 0

    def beat_due_in(self, node: _NodeDesc) -> float:
        """Seconds until ``node``'s (this agent's) next heartbeat is due, on its own clock."""
        last = self._own_beat_at.get(node, -math.inf)
        return last + self.beat_period() - time.monotonic()

    def beat_period(self) -> float:
        """Seconds between this node's heartbeats in the state last read: the configured
        interval up to ``liveness.BEAT_BUDGET`` nodes, longer above (a bounded job rate)."""
        interval = self._settings.keep_alive_interval.total_seconds()
        return beat_period(interval, len(self._state.last_heartbeats))

    def scaled(self) -> bool:
        """Whether the state last read has more nodes than the heartbeat budget: only then
        do the large-round economies apply (below it the agent acts exactly as torch's)."""
        return len(self._state.last_heartbeats) > BEAT_BUDGET

    def beat(self, node: _NodeDesc) -> None:
        """Rule 3: ``node``'s heartbeat goes to its own key; the state is not written."""
        self._own_beat_at[node] = time.monotonic()
        self._liveness.beat(node)
        self._own_beat = (node, datetime.now(timezone.utc))
        self._state.last_heartbeats[node] = self._own_beat[1]

    def _sanitize(self) -> None:
        state = self._state
        if self._own_beat is not None and self._own_beat[0] in state.last_heartbeats:
            node, when = self._own_beat
            state.last_heartbeats[node] = max(state.last_heartbeats[node], when)
        if not state.complete and self.scaled():
            # Above the budget the join folder alone prunes the forming round it folds;
            # here only the signs of life are noted, for when this agent must judge.
            self._liveness.observe(state)
            self._dead_nodes = []
            return
        self._dead_nodes = self._liveness.dead(state, idle=self._idle(state))
        if state.round != self._reported_round:
            self._reported_round, self._reported_dead = state.round, set()
        fresh = sorted(node_name(node) for node in set(self._dead_nodes) - self._reported_dead)
        if fresh:
            # One line per sync, not per node: at K = 512 every agent logging each
            # pruned node was 37 000 lines a round and most of the simulator's CPU.
            ends = state.complete and any(node in state.participants for node in self._dead_nodes)
            log.info(
                "rendezvous_nodes_pruned", count=len(fresh), nodes=fresh[:8], round=state.round,
                round_ended=ends,  # rule 2: a participant of a completed round
            )  # fmt: skip
        self._reported_dead |= set(self._dead_nodes)
        _remove_nodes(state, self._dead_nodes, self._settings)


def _remove_nodes(
    state: _RendezvousState, nodes: list[_NodeDesc], settings: RendezvousSettings
) -> None:
    """torch's sanitizer: drop ``nodes`` from every list of ``state``; a participant
    dropped from a completed round ends it (rule 2)."""
    removed = []
    for node in nodes:
        state.last_heartbeats.pop(node, None)
        if state.participants.pop(node, None) is not None:
            removed.append(node)
        state.wait_list.discard(node)
        state.redundancy_list.discard(node)
    if removed and state.complete and state.participants:
        end_round(state)
    elif removed:
        _remove_participant_epilogue(state, settings)


def end_round(state: _RendezvousState) -> None:
    """End the completed round of ``state`` for its remaining participants (rules 1
    and 2): they see it ended (:func:`round_ended`) and join the next one."""
    # The others are in no list now, so their heartbeats are no one's concern
    # until they join again (with a fresh one): left in, K stale entries made
    # every agent judge, and prune, every other one while the next round formed.
    for node in state.participants:
        state.last_heartbeats.pop(node, None)
    state.participants.clear()
    state.complete = False
    state.deadline = None
    state.round += 1


class FastOpExecutor(_DistributedRendezvousOpExecutor):
    """torch's executor with rules 1 and 3 and a join loop that waits for changes, not 1 s."""

    def __init__(
        self,
        node: _NodeDesc,
        state_holder: WatchedStateHolder,
        settings: RendezvousSettings,
        *,
        changes: ChangeWaiter | None,
        joins: JoinRequester | None = None,
        offer_to_lead: Callable[[int, bool], None] = lambda token, scaled: None,
    ) -> None:
        super().__init__(node, state_holder, settings)
        self._holder = state_holder
        self._changes = changes
        self._joins = joins  # None: torch's way, every node writes its own join
        self._offer_to_lead = offer_to_lead
        self._deferred = False
        #: The exit step of this ``next_rendezvous`` is done (the handler resets it).
        self.exit_done = False

    def apply_for(self, node: _NodeDesc, state: _RendezvousState, action: _Action) -> None:
        """Apply torch's ``action`` for ``node`` (not this agent) to ``state``: the join fold."""
        other = FastOpExecutor(node, self._holder, self._settings, changes=None)
        other._state = state
        other._apply(action)

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        record_event(
            self,
            run_id=self._settings.run_id,
            message=message,
            node_state=node_state,
            node=self._node,
        )

    def run(
        self,
        state_handler: Callable[[_RendezvousContext, float], _Action],
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        exiting = isinstance(state_handler, _RendezvousExitOp)
        if exiting and self.exit_done:
            # A retry after an etcd outage: this node already left its old round and
            # may be in the one forming; leaving that would rewrite the state under
            # every agent (and the folder's batch), once per agent whose call timed out.
            return
        action = None
        conflicts = 0
        self._deferred = False
        while action != _Action.FINISH:
            written = self._state_holder.sync()
            if written is False:  # another node wrote first
                conflicts += 1
                _backoff(conflicts)
                continue  # the state is the winner's now; decide again
            conflicts = 0 if written else conflicts
            self._state = self._state_holder.state
            action = state_handler(
                _RendezvousContext(self._node, self._state, self._settings), deadline
            )
            if action == _Action.FINISH:
                continue
            if action == _Action.ERROR_CLOSED:
                raise RendezvousClosedError
            if action == _Action.ERROR_TIMEOUT:
                raise RendezvousTimeoutError
            if action == _Action.KEEP_ALIVE and self._node in self._state.last_heartbeats:
                if self._holder.scaled() and not self._holder.beat_due(self._node):
                    # torch's interval is due, but a round above the budget beats less often
                    wait = min(self._wait_seconds(), self._holder.beat_due_in(self._node) + 0.005)
                    self._changes.wait_for_change(wait)  # type: ignore[union-attr]
                else:
                    self._holder.beat(self._node)  # rule 3
                continue
            if self._by_folder(action):
                continue
            if action == _Action.SYNC:
                if self._changes.wait_for_change(self._wait_seconds()):
                    # Every waiting node wakes on each change; spreading the
                    # re-reads lets one read cover the changes that follow.
                    time.sleep(random.uniform(0, _WAKE_SPREAD))
                continue
            self._apply(action)
            if action == _Action.REMOVE_FROM_REDUNDANCY_LIST and update_deadline is not None:
                deadline = update_deadline(self._settings.timeout.join)
            self._state_holder.mark_dirty()
        self.exit_done = self.exit_done or exiting

    def _by_folder(self, action: _Action) -> bool:
        """Whether ``action`` is left to the join folder (batched joins): a join step is
        posted as a request; completing the round is left to the folder for a moment,
        so that the participants do not all race to write it at the deadline."""
        if self._joins is None or self._changes is None:
            return False
        scaled, token = self._holder.scaled(), self._holder.token
        if action in JOIN_ACTIONS:
            self._joins.request(self._state, token=token)
            self._offer_to_lead(token, scaled)
            listed = self._node in self._state.last_heartbeats
            if self._holder.beat_due(self._node) and (listed or not scaled):
                # torch's node would be in the state with a fresh heartbeat by now;
                # one that waits for the fold must not look dead meanwhile (rule 3).
                # Above the budget a node not in the state yet skips it: nobody judges
                # it before the fold gives it a fresh entry (512 puts a second for nothing).
                self._holder.beat(self._node)
            self._changes.wait_for_change(self._wait_seconds())
            return True
        if action != _Action.MARK_RENDEZVOUS_COMPLETE:
            return False
        # The folder completes the round at the deadline; the others do it themselves
        # only if it has not within one keep-alive interval (it died), and never while
        # a join request that the folder would have folded first is pending.
        if self._deferred and not self._joins.others_pending(self._state):
            return scaled and self._judge_before_completing()
        if self._deferred:
            self._offer_to_lead(token, False)  # no folder left to fold them: be it
        self._deferred = True
        wait = self._settings.keep_alive_interval.total_seconds()
        self._changes.wait_for_change(wait * random.uniform(1.0, 1.2))
        return True

    def _judge_before_completing(self) -> bool:
        """Above the budget (where only the folder judges a forming round): judge who is
        alive, as the dead folder would have, before completing the round in its place.
        True: not yet (this agent waits until it can judge, or writes the pruned state
        and decides again)."""
        wait = self._holder.unprimed_for()
        if wait > 0:
            self._changes.wait_for_change(wait)  # type: ignore[union-attr]
            return True
        if self._holder.prune(self._state):
            self._state_holder.mark_dirty()  # the next sync writes it
            return True
        return False

    def _apply(self, action: _Action) -> None:
        handlers: dict[_Action, Callable[[], None]] = {
            _Action.KEEP_ALIVE: self._keep_alive,
            _Action.ADD_TO_PARTICIPANTS: self._add_to_participants,
            _Action.ADD_TO_WAIT_LIST: self._add_to_wait_list,
            _Action.ADD_TO_REDUNDANCY_LIST: self._add_to_redundancy_list,
            _Action.REMOVE_FROM_PARTICIPANTS: self._remove_from_participants,
            _Action.REMOVE_FROM_WAIT_LIST: self._remove_from_wait_list,
            _Action.REMOVE_FROM_REDUNDANCY_LIST: self._remove_from_redundancy_list,
            _Action.MARK_RENDEZVOUS_COMPLETE: self._mark_rendezvous_complete,
            _Action.MARK_RENDEZVOUS_CLOSED: self._mark_rendezvous_closed,
        }
        handlers[action]()

    def _wait_seconds(self) -> float:
        """Until the next heartbeat is due or the last call ends, at most 1 s."""
        now = datetime.now(timezone.utc)
        wait = _MAX_WAIT
        beat = self._state.last_heartbeats.get(self._node)
        if beat is not None:
            period = timedelta(seconds=self._holder.beat_period())
            wait = min(wait, (beat + period - now).total_seconds())
        if self._state.deadline is not None and self._node in self._state.participants:
            wait = min(wait, (self._state.deadline - now).total_seconds())
        return max(wait, 0.0) + 0.005  # just past the instant, so the next check passes

    def _remove_from_participants(self) -> None:
        state = self._state
        if not state.complete:
            state.last_heartbeats.setdefault(self._node, datetime.now(timezone.utc))
            super()._remove_from_participants()
            return
        # Rule 1: the round is over for everyone; the others join the next one.
        log.info(
            "rendezvous_round_ended", round=state.round, left=node_name(self._node),
            others=len(state.participants) - 1,
        )  # fmt: skip
        end_round(state)
