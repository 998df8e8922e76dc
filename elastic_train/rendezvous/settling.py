"""When a completed round has settled for this agent: its workers formed their group.

Between a round's completion and the moment its workers have formed their
process group, a node that dies leaves nothing for the survivors to notice:
no peer's collective fails (there is no group yet), the in-process liveness
responders do not run yet, and the agents are silent in etcd (rule 2 of
:mod:`elastic_train.rendezvous.rules`). The survivors' workers then wait for
the dead node's workers at their store until it times out
(``pg_timeout_seconds``, 60 s by default: 57 s from a kill to the next step
was measured). So the round *settles* first: its agents keep heartbeating and
judge each other's heartbeats, and a participant found dead ends the round,
until this agent's workers say they formed the group (``formed(round)``).

Nothing here reads another host's clock: every time is this process's
``time.monotonic()``.

Two phases, each judged by this agent alone:

- *forming*, from the first time this agent reads the completed round with
  itself among the participants until it sees its workers' word: it beats,
  and the participants' clocks run (a silent one is pruned, which ends the
  round, rule 2);
- *grace*, ``grace`` seconds more: it still beats but judges nobody. The
  other agents see their own workers' word up to a heartbeat interval later;
  a node that fell silent at once could look dead to them meanwhile. A node
  that dies now, with the group formed, is the workers' to handle (in-process
  recovery, or a failed collective and a restart), not a reason to restart
  everyone.

``limit``: the longest a round forms. Workers that never report (a script
that is not elastic_train's, a worker that fails before the group) would
otherwise keep their agent beating for the whole run; past the limit, the
workers' own store timeout bounds the wait as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from elastic_train.log import get_logger

__all__ = ["SETTLE_LIMIT_S", "Settling"]

log = get_logger(__name__)

#: The longest a round settles, in seconds: twice the workers' default store timeout.
SETTLE_LIMIT_S = 120.0


class Settling:
    """The phase of the round this agent joined last (module docstring).

    Args:
        formed: ``formed(round)``: whether this agent's workers of ``round`` have
            formed their process group.
        grace: seconds this agent still beats after it saw ``formed`` hold.
        limit: seconds after which a round that has not formed counts as settled.
    """

    def __init__(
        self, formed: Callable[[int], bool], *, grace: float, limit: float = SETTLE_LIMIT_S
    ) -> None:
        self._formed = formed
        self._grace, self._limit = grace, limit
        self._lock = threading.Lock()
        self._round: int | None = None
        self._seen_at = 0.0
        self._formed_at: float | None = None
        self._over = False

    def judging(self, round_: int) -> bool:
        """Whether this agent judges the participants of ``round_`` (it forms)."""
        return self._phase(round_) == "forming"

    def beating(self, round_: int) -> bool:
        """Whether this agent heartbeats as a participant of ``round_``."""
        return self._phase(round_) in ("forming", "grace")

    def _phase(self, round_: int) -> str:
        """``round_``: a completed round with this agent among its participants."""
        with self._lock:
            now = time.monotonic()
            if self._round is None or round_ > self._round:  # its first sight of the round
                self._round, self._seen_at, self._formed_at, self._over = round_, now, None, False
            if round_ != self._round or self._over:
                return "settled"
            if self._formed_at is None and self._formed(round_):
                self._formed_at = now
                log.info(
                    "rendezvous_round_formed", round=round_, seconds=round(now - self._seen_at, 3)
                )
            if self._formed_at is None:
                if now - self._seen_at <= self._limit:
                    return "forming"
                # The workers never said so: their store timeout bounds a loss again.
                log.warning("rendezvous_round_settle_limit", round=round_, limit=self._limit)
                self._over = True
                return "settled"
            if now - self._formed_at < self._grace:
                return "grace"
            self._over = True
            return "settled"
