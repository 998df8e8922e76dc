"""``ElasticSampler``: an exactly-once data order that survives any resize.

The position in the data is one global number, ``samples_consumed`` inside the
epoch's permutation, with no world size in it. Every rank computes the same
global batch (the next ``global_batch_size`` indices of the permutation) and
takes its own contiguous shard of it. After a restart at any world size the
remaining samples of the epoch are simply dealt out again, so no sample is
padded, duplicated or dropped.

A stream dataset (``workload.datasets.PositionalStream``) keeps its own order,
so its sampler does not shuffle: index ``i`` is position ``i`` of the epoch's
stream, and a rank's shard of each global batch is one contiguous read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from elastic_train.errors import ConfigError
from elastic_train.workload.datasets import derived_seed

if TYPE_CHECKING:
    from elastic_train.workload.datasets import DataBundle

_STATE_KEYS = frozenset({"seed", "epoch", "samples_consumed"})


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class ElasticSampler:
    """Deterministic global batches from ``(seed, epoch, samples_consumed)``."""

    def __init__(
        self, dataset_len: int, *, global_batch_size: int, seed: int, shuffle: bool = True
    ) -> None:
        self.dataset_len = _check_int("dataset_len", dataset_len, minimum=1)
        self.global_batch_size = _check_int("global_batch_size", global_batch_size, minimum=1)
        self.seed = _check_int("seed", seed, minimum=0)
        #: False: every epoch in index order (a stream that orders itself).
        self.shuffle = shuffle
        self.epoch = 0
        self.samples_consumed = 0
        self._cached: tuple[int, int, list[int]] | None = None

    @classmethod
    def for_data(cls, data: DataBundle, *, global_batch_size: int, seed: int) -> ElasticSampler:
        """The sampler of ``data``: shuffled, except for a stream, which orders itself."""
        return cls(len(data), global_batch_size=global_batch_size, seed=seed,
                   shuffle=not data.streamed)  # fmt: skip

    def copy(self) -> ElasticSampler:
        """An independent sampler at the same position (a look-ahead cursor)."""
        twin = ElasticSampler(
            self.dataset_len, global_batch_size=self.global_batch_size, seed=self.seed,
            shuffle=self.shuffle,
        )  # fmt: skip
        twin.load_state_dict(self.state_dict())
        twin._cached = self._cached  # the order list is never mutated, so sharing it is safe
        return twin

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of the dataset in ``epoch``; the same on every rank and every run."""
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        generator = torch.Generator()
        generator.manual_seed(derived_seed("elastic_train.sampler", self.seed, epoch))
        return torch.randperm(self.dataset_len, generator=generator)

    def _current_order(self) -> list[int]:
        key = (self.seed, self.epoch)
        if self._cached is None or self._cached[:2] != key:
            self._cached = (*key, self.permutation(self.epoch).tolist())
        return self._cached[2]

    def steps_remaining_in_epoch(self) -> int:
        """Global steps left in the current epoch (the last one may be short)."""
        left = self.dataset_len - self.samples_consumed
        return -(-left // self.global_batch_size)

    def next_global_batch(self) -> list[int]:
        """The next ``<= global_batch_size`` indices of this epoch; advances the position."""
        if self.epoch_finished():
            raise RuntimeError(
                f"epoch {self.epoch} is finished ({self.samples_consumed} of "
                f"{self.dataset_len} samples consumed); call start_next_epoch() first"
            )
        start = self.samples_consumed
        stop = min(start + self.global_batch_size, self.dataset_len)
        batch = self._current_order()[start:stop]
        self.samples_consumed = stop
        return batch

    def epoch_finished(self) -> bool:
        return self.samples_consumed >= self.dataset_len

    def start_next_epoch(self) -> None:
        self.epoch += 1
        self.samples_consumed = 0

    @staticmethod
    def shard(indices: list[int], rank: int, world_size: int) -> list[int]:
        """Rank ``rank``'s contiguous share of ``indices``; share sizes differ by at most one.

        The first ``len(indices) % world_size`` ranks get one extra sample. A rank
        gets nothing only when ``world_size > len(indices)``.
        """
        _check_int("world_size", world_size, minimum=1)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
        base, extra = divmod(len(indices), world_size)
        start = rank * base + min(rank, extra)
        return list(indices[start : start + base + (1 if rank < extra else 0)])

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "samples_consumed": self.samples_consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a saved position; it is valid at any world size."""
        if not isinstance(state, dict) or set(state) != _STATE_KEYS:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ConfigError(
                f"sampler state must have exactly the keys {sorted(_STATE_KEYS)}, got {got}"
            )
        seed = _check_int("sampler state 'seed'", state["seed"], minimum=0)
        epoch = _check_int("sampler state 'epoch'", state["epoch"], minimum=0)
        consumed = _check_int(
            "sampler state 'samples_consumed'", state["samples_consumed"], minimum=0
        )
        if consumed > self.dataset_len:
            raise ConfigError(
                f"sampler state 'samples_consumed' is {consumed}, more than dataset_len "
                f"{self.dataset_len}: the checkpoint belongs to a larger dataset"
            )
        self.seed, self.epoch, self.samples_consumed = seed, epoch, consumed
