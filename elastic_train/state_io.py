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
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from elastic_train.errors import CheckpointError

# Plain values torch.load(weights_only=True) accepts as they are.
_ATOMIC = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)


def map_tensors(state: Any, fn: Callable[[torch.Tensor], Any], *, path: str = "state") -> Any:
    """A copy of the nested ``state`` with every tensor replaced by ``fn(tensor)``.

    A tensor that appears twice (tied weights) is mapped once and stays one
    object. Anything that ``torch.load(weights_only=True)`` would refuse is
    rejected, naming its key, so a bad state fails at save time and not at
    the next resume.
    """
    memo: dict[int, Any] = {}

    def visit(obj: Any, where: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in memo:
                memo[id(obj)] = fn(obj)
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


def copy_to_host(state: Any) -> Any:
    """A deep copy of ``state`` with every tensor copied to CPU memory (see map_tensors)."""
    return map_tensors(state, lambda tensor: tensor.detach().to("cpu", copy=True))


def config_fingerprint(fields: Mapping[str, Any]) -> str:
    """A short stable hash of the config fields that must not change across a resume."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class _Crc32:
    """crc32 behind hashlib's interface: enough to detect a torn write, 3x faster than sha256."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new_hasher(algorithm: str) -> Any:
    """A hashlib-like object for ``algorithm`` (``sha256`` or ``crc32``)."""
    return _Crc32() if algorithm == "crc32" else hashlib.new(algorithm)


def checksum(data: bytes | memoryview, algorithm: str) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


class HashingWriter:
    """A file wrapper that hashes what torch.save writes, so the file is read zero times."""

    def __init__(self, file: BinaryIO, algorithm: str) -> None:
        self._file = file
        self.hasher = new_hasher(algorithm)
        self.size = 0
        #: torch.save turns a failed write into an errno-less RuntimeError; keep the real one.
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.hasher.update(data)
        self.size += len(data)
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._file.flush()


def save_hashed(state: Any, file: BinaryIO, *, algorithm: str) -> tuple[str, int]:
    """``torch.save`` into ``file``; returns (checksum, bytes). A failed write raises OSError."""
    writer = HashingWriter(file, algorithm)
    try:
        torch.save(state, writer)
    except RuntimeError as exc:
        raise (writer.error or exc) from exc
    return writer.hasher.hexdigest(), writer.size


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
