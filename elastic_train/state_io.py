"""Host copies of training state and the small file helpers shared by checkpoints and snapshots.

Everything that leaves the training process (a disk checkpoint, a shared-memory
snapshot) goes through :func:`copy_to_host` first: it decouples the copy from
the live tensors the next step mutates, and it rejects anything that
``torch.load(weights_only=True)`` would refuse, naming the key.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from elastic_train.errors import CheckpointError

# Plain values torch.load(weights_only=True) accepts as they are.
_ATOMIC = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)


def copy_to_host(state: Any, *, path: str = "state") -> Any:
    """A deep copy of ``state`` with every tensor copied to CPU memory.

    Tensors that appear twice (tied weights) stay one tensor. Anything that
    ``torch.load(weights_only=True)`` would refuse is rejected here, naming
    its key, so a bad state fails at save time and not at the next resume.
    """
    memo: dict[int, torch.Tensor] = {}

    def visit(obj: Any, where: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in memo:
                memo[id(obj)] = obj.detach().to("cpu", copy=True)
            return memo[id(obj)]
        if isinstance(obj, _ATOMIC):
            return obj
        if isinstance(obj, Mapping):
            items = [(k, visit(v, f"{where}[{k!r}]")) for k, v in obj.items()]
            return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
        if isinstance(obj, (list, tuple)):
            values = [visit(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            return values if isinstance(obj, list) else tuple(values)
        raise CheckpointError(
            f"{where} is a {type(obj).__qualname__}; checkpoint state may hold only tensors, "
            "numbers, strings, bytes, None, dtypes, devices and dicts/lists/tuples of them"
        )

    return visit(state, path)


def config_fingerprint(fields: Mapping[str, Any]) -> str:
    """A short stable hash of the config fields that must not change across a resume."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class HashingWriter:
    """A file wrapper that hashes what torch.save writes, so the file is read zero times."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.sha256 = hashlib.sha256()
        self.size = 0
        #: torch.save turns a failed write into an errno-less RuntimeError; keep the real one.
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._file.flush()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
