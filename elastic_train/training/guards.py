"""What the training loop consults after every step besides training itself.

:class:`LoopGuards` bundles the preemption handler (stop at an agreed step,
save, leave) and the hang watchdog; :func:`build_eval_set` picks the
evaluation data. The loop in ``train.py`` adds :meth:`PreemptionHandler.flag`
to its per-step all-reduce and calls :meth:`LoopGuards.after_step` with the
result once per optimizer step on every rank.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from elastic_train.config.checks import parse_signal
from elastic_train.config.job import EvalConfig, JobConfig
from elastic_train.training.preemption import PreemptionHandler, StopReason
from elastic_train.training.watchdog import Watchdog
from elastic_train.workload.datasets import DataBundle
from elastic_train.workload.registry import DATASETS


class LoopGuards:
    """Preemption and hang detection for one worker; :meth:`install` on the main thread."""

    def __init__(self, cfg: JobConfig, *, device: torch.device) -> None:
        elastic = cfg.elastic
        self.preemption = PreemptionHandler(
            signals=(signal.SIGTERM, parse_signal(elastic.preemption_signal)),
            check_every=elastic.preemption_check_every,
            device=device,
        )
        self.watchdog: Watchdog | None = None
        if elastic.watchdog:
            self.watchdog = Watchdog(
                timeout_s=elastic.watchdog_timeout_seconds or None,
                multiple=elastic.watchdog_multiple,
                floor_s=elastic.watchdog_floor_seconds,
                startup_timeout_s=elastic.watchdog_startup_seconds,
            )

    def install(self) -> LoopGuards:
        """Catch the preemption signals and start the watchdog's clock."""
        self.preemption.install()
        if self.watchdog is not None:
            self.watchdog.start()
        return self

    def after_step(self, step: int, *, signalled: bool | None) -> StopReason | None:
        """Record progress; whether every rank stops now.

        ``signalled`` is the all-reduced preemption flag when the ranks agreed
        after this step (see :meth:`PreemptionHandler.flag`), else None.
        """
        if self.watchdog is not None:
            self.watchdog.step_done(step)
        if signalled is None:
            return None
        return self.preemption.decide(step, signalled=signalled)

    def settle(self, reason: StopReason) -> StopReason:
        """The reason to exit with, once the stop step is saved: a signal that
        reached this worker after the all-reduce (the agent signals its workers
        one by one) makes it a preempted worker too, which exits 0."""
        if reason is StopReason.PEER_PREEMPTED and self.preemption.received is not None:
            return StopReason.PREEMPTED
        return reason

    @contextlib.contextmanager
    def long_operation(self, name: str) -> Iterator[None]:
        """A save or an evaluation: bounded by the startup limit, not the step limit."""
        if self.watchdog is None:
            yield
            return
        with self.watchdog.long_operation(name):
            yield

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.preemption.uninstall()


def build_eval_set(cfg: JobConfig, train_data: DataBundle) -> Dataset[Any] | None:
    """The evaluation samples, or None when evaluation is off."""
    ev: EvalConfig = cfg.eval
    if not ev.every_steps and not ev.at_end:
        return None
    data = DATASETS.resolve(ev.dataset)(cfg.data) if ev.dataset else train_data
    if ev.max_samples and ev.max_samples < len(data):
        return Subset(data.dataset, range(ev.max_samples))
    return data.dataset
