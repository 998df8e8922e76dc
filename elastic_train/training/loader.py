"""DataLoader workers that load this rank's coming micro-batches ahead of the step.

With ``data.num_workers > 0`` a torch ``DataLoader`` runs the dataset and the
collate function in worker processes. What it loads is planned, not sampled:
:class:`StepPlan` walks a *copy* of the :class:`ElasticSampler` ahead of the
real one and yields, step after step, the ``(epoch, indices)`` of each
micro-batch this rank will need (:func:`~elastic_train.training.step.step_chunks`,
the same split the step makes). The step asks for its micro-batch by those
indices and gets the loaded one only if the keys agree; otherwise it loads the
batch itself and prefetching stops for the attempt, so correctness never rests
on the plan.

Exactly-once: only the real sampler, advanced when a step takes its global
batch, is saved in checkpoints and snapshots. Micro-batches the workers loaded
for steps that never completed are simply dropped with the workers; the
restarted attempt plans again from the restored global position, at whatever
world size it has.

Worker processes die with the trainer: each sets ``PR_SET_PDEATHSIG`` (Linux),
so even a SIGKILLed trainer leaves none behind, and ignores the stop signals
the trainer handles (torchrun's agent signals the trainer's whole process
group): a trainer that is saving after SIGTERM must not see its workers die
under it (torch's SIGCHLD handler would raise in the middle of the save).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from elastic_train.config.job import DataConfig
from elastic_train.errors import DataLoadingError, ElasticTrainError
from elastic_train.log import get_logger
from elastic_train.training.sampler import ElasticSampler
from elastic_train.training.step import step_chunks
from elastic_train.workload.datasets import derived_seed

if TYPE_CHECKING:
    from elastic_train.training.batches import BatchLoader

log = get_logger(__name__)

#: One micro-batch's key: its epoch and its sample indices, in order.
Key = tuple[int, tuple[int, ...]]

_PR_SET_PDEATHSIG = 1
#: Signals a worker ignores: its trainer handles them (preemption) and ends it.
_TRAINER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class StepPlan:
    """The keys of this rank's coming micro-batches: the DataLoader's sampler.

    Each ``iter()`` yields the rest of one epoch (the DataLoader starts one
    iterator per epoch, which is where ``persistent_workers`` matters) and
    stops at ``until_step`` (``training.steps``) or after epoch
    ``until_epoch - 1`` (``training.epochs``), whichever is set.
    """

    def __init__(
        self, ahead: ElasticSampler, *, rank: int, world_size: int, micro_batch_size: int,
        step: int, until_step: int, until_epoch: int, first_ranks: int | None = None,
    ) -> None:  # fmt: skip
        self.ahead, self.rank, self.world_size = ahead, rank, world_size
        self.micro_batch_size = micro_batch_size
        self.step, self.until_step, self.until_epoch = step, until_step, until_epoch
        #: The ranks that split the first step's batch: the members alone while
        #: joiners heal (training/heal.py).
        self.first_ranks = world_size if first_ranks is None else first_ranks

    def done(self) -> bool:
        if self.until_step > 0:
            return self.step >= self.until_step
        return self.ahead.epoch >= self.until_epoch

    def __iter__(self) -> Iterator[Key]:
        # A generator: nothing moves until the DataLoader draws (it makes and
        # drops one iterator unused when it starts).
        while not self.done():
            epoch = self.ahead.epoch
            batch = self.ahead.next_global_batch()
            self.step += 1
            ranks, self.first_ranks = self.first_ranks, self.world_size
            shard = ElasticSampler.shard(batch, self.rank, ranks) if self.rank < ranks else []
            for chunk in step_chunks(batch, shard, self.micro_batch_size)[0]:
                yield epoch, tuple(chunk)
            if self.ahead.epoch_finished():
                self.ahead.start_next_epoch()
                return


class PlannedBatches(Dataset[tuple[Key, Any]]):
    """What a worker computes for a key: ``(key, the collated micro-batch on the CPU)``."""

    def __init__(self, batches: BatchLoader) -> None:
        self.batches = batches

    def __getitem__(self, key: Key) -> tuple[Key, Any]:  # type: ignore[override]
        epoch, indices = key
        return key, self.batches.collate(indices, epoch=epoch)


def _as_loaded(item: Any) -> Any:
    return item  # the worker collated already (PlannedBatches)


def _worker_init(worker_id: int, *, trainer_pid: int) -> None:
    """In each worker: die with the trainer, leave stop signals to the trainer."""
    for sig in _TRAINER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if sys.platform == "linux":
        # Not agent/warm_start's helper: training may not import agent (docs/DESIGN.md).
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != trainer_pid:  # the trainer died before the prctl took effect
        os._exit(1)


class Prefetcher:
    """A DataLoader over a :class:`StepPlan`; :meth:`take` hands out its batches in order."""

    def __init__(
        self, batches: BatchLoader, plan: StepPlan, cfg: DataConfig, *, pin: bool, seed: int
    ) -> None:
        self.workers = cfg.num_workers
        # The workers' base seed comes from this generator, not from torch's
        # global one, which the checkpoint restores and the step draws from.
        position = ("elastic_train.loader", seed, plan.ahead.epoch,
                    plan.ahead.samples_consumed, plan.rank)  # fmt: skip
        self.loader = DataLoader(
            PlannedBatches(batches), batch_size=None, sampler=plan,  # type: ignore[arg-type]
            num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor or None,
            persistent_workers=cfg.persistent_workers, pin_memory=pin, collate_fn=_as_loaded,
            worker_init_fn=functools.partial(_worker_init, trainer_pid=os.getpid()),
            generator=torch.Generator().manual_seed(derived_seed(*position)),
        )  # fmt: skip
        self._iterator: Iterator[tuple[Key, Any]] | None = iter(self.loader)  # workers start now

    def take(self, epoch: int, indices: Sequence[int]) -> tuple[bool, Any]:
        """``(True, batch)`` when the next loaded micro-batch is the one of these
        indices; ``(False, None)`` otherwise (the plan ran out or went another way)."""
        key = (epoch, tuple(indices))
        for _ in range(2):  # at an epoch's end, one more try in the next epoch's iterator
            if self._iterator is None:
                self._iterator = iter(self.loader)
            try:
                loaded_key, batch = next(self._iterator)
            except StopIteration:
                self._iterator = None
                continue
            except ElasticTrainError:
                raise  # the collate function's ConfigError, raised again by torch
            except Exception as exc:
                raise DataLoadingError(
                    f"data.num_workers = {self.workers}: a DataLoader worker failed loading "
                    f"the micro-batch of epoch {epoch}, indices {list(indices[:8])}...: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if loaded_key == key:
                return True, batch
            log.warning("prefetch_out_of_step", epoch=epoch, wanted=list(indices[:8]),
                        loaded_epoch=loaded_key[0], loaded=list(loaded_key[1][:8]))  # fmt: skip
            return False, None
        log.warning("prefetch_plan_ended", epoch=epoch, wanted=list(indices[:8]))
        return False, None

    def close(self) -> None:
        """Stop the workers now (and their pin thread); nothing they loaded is kept."""
        iterator, self._iterator = self._iterator, None
        if iterator is None:
            iterator = getattr(self.loader, "_iterator", None)  # persistent workers between epochs
        shutdown = getattr(iterator, "_shutdown_workers", None)  # torch has no public close
        if shutdown is not None:
            with contextlib.suppress(Exception):
                shutdown()
        self.loader._iterator = None  # type: ignore[attr-defined]
