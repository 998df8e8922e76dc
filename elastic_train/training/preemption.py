"""Graceful preemption: finish the step, save, exit.

torchrun's agent turns SIGTERM (SIGINT, SIGHUP, SIGQUIT and whatever
``TORCHELASTIC_SIGNALS_TO_HANDLE`` lists) into ``SignalException``, forwards
the same signal to every local worker, waits ``shutdown_timeout`` (30 s) and
then SIGKILLs them, and finally exits itself without leaving the rendezvous,
so the node can rejoin later. A worker therefore has 30 s from the signal to a
finished checkpoint.

The signal handler only sets a flag: a Python handler runs between bytecodes
of the main thread, never inside a collective, so nothing it touches can be
half-updated. Every rank must see the same answer at the same step, so the
flag is all-reduced at check steps (:meth:`PreemptionHandler.check_due`: about
every 50 ms of training, at the same steps on every rank): the trainer adds it
to the small all-reduce of its loss (``train.Agreement``) and hands the result
to :meth:`PreemptionHandler.decide`; :meth:`PreemptionHandler.poll` does the
same with an all-reduce of its own for other loops. The ranks that were signalled
stop with :data:`StopReason.PREEMPTED`, every other rank with
:data:`StopReason.PEER_PREEMPTED`. All ranks then take part in one synchronous
save of that step, so the node that leaves loses zero steps. The signalled
worker exits 0; a survivor exits :data:`elastic_train.errors.EXIT_PEER_PREEMPTED`
so that its agent restarts it into the next rendezvous round instead of
reporting the job as finished.
"""

from __future__ import annotations

import enum
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.errors import ConfigError
from elastic_train.log import get_logger

log = get_logger(__name__)

#: Adaptive checks (``check_every=0``) come about this often: a signal is acted
#: on within this time plus one step, far inside torchrun's 30 s grace period.
#: A check is a second collective in its step, and its latency, not its bytes,
#: is the cost: 1-3.5 ms a check on 2 gloo ranks of this 2-core box (a 30 ms
#: step took 38.7 ms with a check, 35.2 ms without). At 50 ms every step of
#: 50 ms or more paid it (7-9 % of a paced 38 ms step); at 0.25 s a check costs
#: about 1 % of any step, and a signal or a join waits 0.12 s more on average.
CHECK_SECONDS = 0.25
MAX_CHECK_INTERVAL = 1000


class StopReason(str, enum.Enum):
    PREEMPTED = "preempted"
    PEER_PREEMPTED = "peer_preempted"


class PreemptionHandler:
    """Turns termination signals into a stop decision that all ranks share.

    Args:
        signals: the signals that mean "save and leave" (SIGTERM plus the
            configured extra one, SIGUSR1 by default for Slurm's ``--signal``).
        check_every: agree on the flag every this many steps; 0 (the
            default): about every :data:`CHECK_SECONDS`, at an interval that
            global rank 0 proposes from its step time (:meth:`propose_interval`,
            :meth:`checked`), so fast steps skip the collective and slow ones
            check every step. A signal is acted on at the first check after it.
        device: where the flag tensor lives (``cuda`` for NCCL).
    """

    def __init__(
        self,
        *,
        signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGUSR1),
        check_every: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if check_every < 0:
            raise ConfigError(
                f"preemption check_every must be >= 0 (0: adaptive), got {check_every}"
            )
        if signal.SIGKILL in signals or signal.SIGSTOP in signals:
            raise ConfigError("preemption signals cannot include SIGKILL or SIGSTOP")
        self.signals = tuple(dict.fromkeys(signals))
        self.check_every = check_every
        self.device = torch.device(device)
        self._received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._next_check = 0
        self._last_check: tuple[int, float] | None = None  # (step, time.monotonic())

    @property
    def received(self) -> signal.Signals | None:
        """The signal this process received, if any."""
        return self._received

    def install(self) -> PreemptionHandler:
        """Install the handlers; must run on the main thread (a CPython rule)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler.install must be called from the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: a second signal while saving must not re-enter the save.
        if self._received is None:
            self._received = signal.Signals(signum)

    def flag(self) -> float:
        """1.0 once a stop signal arrived here, else 0.0: this rank's term of the sum."""
        return 0.0 if self._received is None else 1.0

    def check_due(self, step: int) -> bool:
        """Whether the ranks agree on the flag after ``step`` (the same on every rank)."""
        if self.check_every:
            return step % self.check_every == 0
        return step >= self._next_check

    def propose_interval(self, step: int) -> int:
        """Steps until the next check after ``step``, from this rank's step time
        since the last check.

        Only global rank 0's proposal counts (the others send 0 and the sum is
        taken), so every rank schedules the same next check.
        """
        if self._last_check is None:
            return 1
        last, started = self._last_check
        steps = max(1, step - last)
        step_seconds = (time.monotonic() - started) / steps
        return max(1, min(MAX_CHECK_INTERVAL, int(CHECK_SECONDS / max(step_seconds, 1e-9))))

    def resync(self) -> None:
        """The group changed members: every rank checks after the next step. A worker
        that joined has no schedule of its own, and a check step that one rank runs
        and another does not is a collective that never completes."""
        self._next_check = 0

    def checked(self, step: int, *, interval: int) -> None:
        """The ranks agreed after ``step``; the next check is ``interval`` steps later."""
        self._last_check = (step, time.monotonic())
        self._next_check = step + max(1, interval)

    def decide(self, step: int, *, signalled: bool) -> StopReason | None:
        """Whether to stop after ``step``, given the all-reduced flag of a check.

        Every rank passes the same ``signalled`` (the result of one collective),
        so every rank gets the same answer at the same step.
        """
        if not signalled:
            return None
        reason = StopReason.PREEMPTED if self._received is not None else StopReason.PEER_PREEMPTED
        log.warning(
            "preemption_stop",
            step=step,
            reason=reason.value,
            signal=self._received.name if self._received else None,
        )
        return reason

    def poll(self, step: int, *, group: dist.ProcessGroup | None = None) -> StopReason | None:
        """:meth:`decide` after an all-reduce of its own, at the steps :meth:`check_due` picks.

        A collective when the process group is initialized: every rank must
        call it after the same steps. The trainer avoids its cost by adding
        :meth:`flag` to the all-reduce it runs anyway.
        """
        if not self.check_due(step):
            return None
        anyone = self._received is not None
        interval = self.propose_interval(step)
        if dist.is_available() and dist.is_initialized():
            is_main = dist.get_rank(group) == 0
            flag = torch.tensor([int(anyone), interval if is_main else 0], device=self.device)
            dist.all_reduce(flag, group=group)
            anyone, interval = bool(flag[0].item()), int(flag[1].item())
        self.checked(step, interval=interval)
        return self.decide(step, signalled=anyone)
