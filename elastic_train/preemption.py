"""Graceful preemption: finish the step, save, exit.

torchrun's agent turns SIGTERM (SIGINT, SIGHUP, SIGQUIT and whatever
``TORCHELASTIC_SIGNALS_TO_HANDLE`` lists) into ``SignalException``, forwards
the same signal to every local worker, waits ``shutdown_timeout`` (30 s) and
then SIGKILLs them, and finally exits itself without leaving the rendezvous,
so the node can rejoin later. A worker therefore has 30 s from the signal to a
finished checkpoint.

The signal handler only sets a flag: a Python handler runs between bytecodes
of the main thread, never inside a collective, so nothing it touches can be
half-updated. The loop asks :meth:`PreemptionHandler.poll` after each
optimizer step. ``poll`` all-reduces the flag (MAX of one int) so that every
rank sees the same answer at the same step: the ranks that were signalled stop
with :data:`StopReason.PREEMPTED`, every other rank with
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
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.errors import ConfigError
from elastic_train.log import get_logger

log = get_logger(__name__)


class StopReason(str, enum.Enum):
    PREEMPTED = "preempted"
    PEER_PREEMPTED = "peer_preempted"


def parse_signal(name: str) -> signal.Signals:
    """``"SIGUSR1"``, ``"USR1"`` or ``"10"`` -> ``signal.SIGUSR1``."""
    text = name.strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError) as exc:
        raise ConfigError(
            f"elastic.preemption_signal = {name!r} is not a signal name; "
            "use e.g. SIGUSR1, SIGUSR2, SIGINT"
        ) from exc


class PreemptionHandler:
    """Turns termination signals into a stop decision that all ranks share.

    Args:
        signals: the signals that mean "save and leave" (SIGTERM plus the
            configured extra one, SIGUSR1 by default for Slurm's ``--signal``).
        check_every: all-reduce the flag every this many steps. 1 (the default)
            costs one 4-byte all-reduce per step; larger values trade that for
            up to ``check_every - 1`` extra steps inside the grace period.
        device: where the flag tensor lives (``cuda`` for NCCL).
    """

    def __init__(
        self,
        *,
        signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGUSR1),
        check_every: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        if check_every < 1:
            raise ConfigError(f"preemption check_every must be >= 1, got {check_every}")
        if signal.SIGKILL in signals or signal.SIGSTOP in signals:
            raise ConfigError("preemption signals cannot include SIGKILL or SIGSTOP")
        self.signals = tuple(dict.fromkeys(signals))
        self.check_every = check_every
        self.device = torch.device(device)
        self._received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

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

    def poll(self, step: int, *, group: dist.ProcessGroup | None = None) -> StopReason | None:
        """Whether to stop after ``step``; the same answer on every rank of ``group``.

        A collective when the process group is initialized: every rank must
        call it after the same steps.
        """
        if step % self.check_every != 0:
            return None
        local = self._received is not None
        anyone = local
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([int(local)], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            anyone = bool(flag.item())
        if not anyone:
            return None
        reason = StopReason.PREEMPTED if local else StopReason.PEER_PREEMPTED
        log.warning(
            "preemption_stop",
            step=step,
            reason=reason.value,
            signal=self._received.name if self._received else None,
        )
        return reason
