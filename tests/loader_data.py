"""Datasets for the DataLoader-worker tests, imported by the trainer as ``tests.loader_data:...``.

``logged_synthetic`` is the built-in ``synthetic`` task behind a plain
``Dataset`` (so items go through ``__getitem__`` in the workers, not the
TensorDataset gather) that writes down what DataLoader workers load:
``{data.options.log_dir}/loaded-{pid}.txt`` gets one index per line, and
``worker-{pid}.json`` the worker's pid, its parent (the trainer) and its
start time, so a test can find loader workers that outlive their trainer.
``logged_stream`` is the built-in ``synthetic_stream`` (a ``PositionalStream``)
logged the same way, one stream position per line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils.data import Dataset, get_worker_info

from elastic_train.config.job import DataConfig
from elastic_train.workload.datasets import DataBundle, synthetic
from elastic_train.workload.streams import synthetic_stream


class LoggedItems(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, inner: Any, log_dir: Path) -> None:
        self.inner, self.log_dir = inner, log_dir
        self._pid = -1
        self._log: Any = None

    def __len__(self) -> int:
        return len(self.inner)

    def _worker_log(self) -> Any:
        if self._pid != os.getpid():  # first item in this (forked) worker
            self._pid = os.getpid()
            me = psutil.Process()
            info = {"pid": me.pid, "ppid": me.ppid(), "created": me.create_time()}
            temporary = self.log_dir / f".worker-{me.pid}.json"
            temporary.write_text(json.dumps(info))
            temporary.rename(self.log_dir / f"worker-{me.pid}.json")  # readers see it whole
            self._log = (self.log_dir / f"loaded-{me.pid}.txt").open("a", buffering=1)
        return self._log

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if get_worker_info() is not None:
            self._worker_log().write(f"{index}\n")
        return self.inner[index]  # type: ignore[no-any-return]


def logged_synthetic(cfg: DataConfig) -> DataBundle:
    """``synthetic``, with worker loads logged to ``data.options.log_dir``."""
    log_dir = Path(cfg.options["log_dir"])
    log_dir.mkdir(parents=True, exist_ok=True)
    base = synthetic(cfg)
    return DataBundle(LoggedItems(base.dataset, log_dir), base.info)


class LoggedStream(LoggedItems):
    """A ``PositionalStream``: ``read`` logs the positions a DataLoader worker reads."""

    def read(self, epoch: int, start: int, count: int) -> Any:
        if get_worker_info() is not None:
            self._worker_log().write("".join(f"{p}\n" for p in range(start, start + count)))
        return self.inner.read(epoch, start, count)


def logged_stream(cfg: DataConfig) -> DataBundle:
    """``synthetic_stream``, with worker reads logged to ``data.options.log_dir``."""
    log_dir = Path(cfg.options["log_dir"])
    log_dir.mkdir(parents=True, exist_ok=True)
    base = synthetic_stream(cfg)
    return DataBundle(LoggedStream(base.dataset, log_dir), base.info)


def loaded_indices(log_dir: Path) -> list[int]:
    """Every index any DataLoader worker loaded, once per load."""
    return [int(line) for path in log_dir.glob("loaded-*.txt") for line in path.read_text().split()]


def loader_workers(log_dir: Path) -> list[dict[str, Any]]:
    """The pid, parent pid and start time of every loader worker that loaded something."""
    return [json.loads(path.read_text()) for path in log_dir.glob("worker-*.json")]


def orphaned(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The loader workers still running although their trainer is gone."""
    found = []
    for info in workers:
        try:
            proc = psutil.Process(info["pid"])
            if abs(proc.create_time() - info["created"]) > 0.01:
                continue  # the pid was reused
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.ppid() != info["ppid"] or not psutil.pid_exists(info["ppid"]):
                found.append(info)
        except psutil.NoSuchProcess:
            continue
    return found
