"""Training state on its way out of the process, shared by checkpoints and snapshots.

Disk checkpoints take a deep CPU copy (:func:`copy_to_host`), which decouples
the background write from the live tensors the next step mutates, and write it
with :func:`save_hashed`. Shared-memory snapshots copy tensors raw and encode
everything else as tagged JSON (:func:`encode_state`). Both reject anything
that ``torch.load(weights_only=True)`` would refuse, naming its key.
"""

from __future__ import annotations

import base64
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


def encode_state(state: Any, tensors: list[torch.Tensor]) -> Any:
    """The state as tagged JSON values; tensors become references into ``tensors``.

    JSON, not pickle: the skeleton has hundreds of small values (optimizer
    param groups, RNG states) that torch.save pickles several times slower,
    and reading JSON back can never construct an arbitrary object. Every dict
    is tagged, so a user's dict can never be mistaken for a tag.
    """
    memo: dict[int, int] = {}

    def visit(obj: Any, where: str) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            if id(obj) not in memo:
                memo[id(obj)] = len(tensors)
                tensors.append(obj)
            return {"ref": memo[id(obj)]}
        if isinstance(obj, Mapping):
            items = [
                [visit(k, f"{where} key"), visit(v, f"{where}[{k!r}]")] for k, v in obj.items()
            ]
            return {"odict" if isinstance(obj, OrderedDict) else "dict": items}
        if isinstance(obj, torch.Size):
            return {"size": list(obj)}
        if isinstance(obj, (list, tuple)):
            values = [visit(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            return values if isinstance(obj, list) else {"tuple": values}
        if isinstance(obj, torch.dtype):
            return {"dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"device": str(obj)}
        if isinstance(obj, bytes):
            return {"bytes": base64.b64encode(obj).decode()}
        raise CheckpointError(
            f"{where} is a {type(obj).__qualname__}; state may hold only tensors, "
            "numbers, strings, bytes, None, dtypes, devices and dicts/lists/tuples of them"
        )

    return visit(state, "state")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r}")
    return dtype


def decode_state(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`encode_state`, given the tensors the references point to."""
    if isinstance(obj, list):
        return [decode_state(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    ((tag, value),) = obj.items()
    if tag in ("dict", "odict"):
        items = [(decode_state(k, tensors), decode_state(v, tensors)) for k, v in value]
        return OrderedDict(items) if tag == "odict" else dict(items)
    decoders = {
        "ref": lambda: tensors[value],
        "tuple": lambda: tuple(decode_state(v, tensors) for v in value),
        "size": lambda: torch.Size(value),
        "dtype": lambda: dtype_from_name(value),
        "device": lambda: torch.device(value),
        "bytes": lambda: base64.b64decode(value),
    }
    if tag not in decoders:
        raise CheckpointError(f"unknown tag {tag!r} in encoded state")
    return decoders[tag]()
