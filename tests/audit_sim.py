"""Synthetic audit records of an elastic run, for the auditor's unit tests.

A tiny stand-in for the trainer's data order (a seeded shuffle per epoch,
fixed global batches, contiguous shards) that writes the DESIGN.md record
format with explicit times, so tests can stage restores and faults exactly.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path


def permutation(dataset_len: int, epoch: int, seed: int = 0) -> list[int]:
    order = list(range(dataset_len))
    random.Random(seed * 1000 + epoch).shuffle(order)
    return order


def shard(indices: list[int], rank: int, world_size: int) -> list[int]:
    base, extra = divmod(len(indices), world_size)
    start = rank * base + min(rank, extra)
    return indices[start : start + base + (1 if rank < extra else 0)]


@dataclass
class SimRun:
    """Writes records for attempts that each restore a step and run some more."""

    directory: Path
    dataset_len: int = 20
    global_batch: int = 6
    time: float = 1000.0
    step_seconds: float = 1.0
    lines: dict[str, list[str]] = field(default_factory=dict)
    _attempts: int = 0

    def batch(self, step: int) -> tuple[int, list[int]]:
        """The epoch and global batch of a step (steps count from 1)."""
        per_epoch = -(-self.dataset_len // self.global_batch)
        epoch, offset = divmod(step - 1, per_epoch)
        start = offset * self.global_batch
        return epoch, permutation(self.dataset_len, epoch)[start : start + self.global_batch]

    def attempt(
        self,
        *,
        world_size: int,
        restored: int,
        last: int,
        source: str = "disk",
        skip_rank_at: tuple[int, int] | None = None,
        batch_of: dict[int, int] | None = None,
    ) -> str:
        """Resume at ``restored``, then run steps ``restored+1..last``.

        ``skip_rank_at=(step, rank)`` drops one rank's record of one step;
        ``batch_of={step: other}`` records the data of another step (a bad restore).
        """
        self._attempts += 1
        attempt = f"a{self._attempts}"
        self.time += 2.0
        for rank in range(world_size):
            self._write(rank, {"kind": "resume", "attempt": attempt, "restored_step": restored,
                               "source": source, "world_size": world_size, "rank": rank,
                               "node": f"node{rank}", "time": self.time})  # fmt: skip
        for step in range(restored + 1, last + 1):
            self.time += self.step_seconds
            epoch, indices = self.batch((batch_of or {}).get(step, step))
            for rank in range(world_size):
                if skip_rank_at == (step, rank):
                    continue
                self._write(rank, {"kind": "step", "attempt": attempt, "step": step,
                                   "epoch": epoch, "rank": rank, "world_size": world_size,
                                   "node": f"node{rank}",
                                   "indices": shard(indices, rank, world_size),
                                   "loss": 1.0 / step, "time": self.time})  # fmt: skip
        return attempt

    def _write(self, rank: int, record: dict[str, object]) -> None:
        path = self.directory / f"worker-node{rank}-{1000 + self._attempts * 10 + rank}.jsonl"
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
