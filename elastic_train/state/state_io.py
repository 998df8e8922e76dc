"""Training state on its way out of the process, shared by checkpoints and snapshots.

Disk checkpoints take a deep CPU copy (:func:`copy_to_host`), which decouples
the background write from the live tensors the next step mutates, and write it
with :func:`save_hashed`. Shared-memory snapshots copy tensors raw and encode
everything else as JSON (:func:`flatten_state`). Both reject anything
that ``torch.load(weights_only=True)`` would refuse, naming its key.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch

from elastic_train.errors import CheckpointError, SnapshotRefusedError

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


_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _distrust(info: os.stat_result, *, is_dir: bool) -> str | None:
    """Why a file or directory of ours cannot be trusted, or None when it can."""
    if not (stat.S_ISDIR(info.st_mode) if is_dir else stat.S_ISREG(info.st_mode)):
        return f"not a {'directory' if is_dir else 'regular file'}"
    if info.st_uid != os.getuid():
        return f"owned by uid {info.st_uid}, not by us (uid {os.getuid()})"
    if is_dir and stat.S_IMODE(info.st_mode) & 0o077:
        return f"mode {stat.S_IMODE(info.st_mode):04o} lets others in, expected 0700"
    return None


def open_private_directory(path: Path) -> int | None:
    """A descriptor of ``path`` once it is a directory of our uid closed to group
    and others; None where it does not exist.

    Opened with ``O_NOFOLLOW`` and checked with ``fstat`` on that descriptor,
    so a symlink is refused and nothing can be swapped in between the check
    and the use (open its files with :func:`open_owned_file`). Raises
    ``SnapshotRefusedError`` naming the path and the reason.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symlink; ENOTDIR: not a directory; EACCES
        raise SnapshotRefusedError(
            f"{path} refused: {exc.strerror} (a symlink, or not a directory?); remove it"
        ) from exc
    problem = _distrust(os.fstat(fd), is_dir=True)
    if problem is not None:
        os.close(fd)
        raise SnapshotRefusedError(f"{path} refused: {problem}; remove it")
    return fd


def open_owned_file(dir_fd: int, name: str, flags: int, *, where: Path) -> int:
    """``os.open`` of ``name`` in a checked directory: no symlink followed, and it must
    be a regular file of our uid (``SnapshotRefusedError`` otherwise)."""
    fd = os.open(name, flags | _NOFOLLOW, 0o600, dir_fd=dir_fd)
    problem = _distrust(os.fstat(fd), is_dir=False)
    if problem is not None:
        os.close(fd)
        raise SnapshotRefusedError(f"{where / name} refused: {problem}")
    return fd


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (so that the names in it persist)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FlatState(NamedTuple):
    """A state taken apart by :func:`flatten_state`.

    ``shape`` is the structure as a flat list of tokens; two states with equal
    shapes differ only in their keys, scalar values and tensor contents, so a
    caller can cache whatever it derives from the shape (see snapshot_layout).
    """

    shape: list[Any]
    keys: list[Any]  # the keys of every dict, a dict's keys before its values' keys
    leaves: list[Any]  # every str/int/float/bool/None value; bytes as base64 text
    tensors: list[torch.Tensor]  # each tensor once, in order of first appearance


# Types that JSON round-trips exactly, as values and as list items (hence as keys).
_SCALARS = frozenset({str, int, float, bool, type(None)})


class _Unsupported(Exception):
    """An object flatten_state cannot encode; the path to it is found afterwards."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj


def flatten_state(state: Any) -> FlatState:
    """The nested ``state`` as a :class:`FlatState`, rejecting what weights_only refuses.

    JSON, not pickle: the skeleton has hundreds of small values (optimizer
    param groups, RNG states) that torch.save pickles several times slower,
    and reading JSON back can never construct an arbitrary object. A snapshot
    runs this after every optimizer step, so the walk does as little as it
    can per object: no path strings (built only to name a bad key), keys
    collected a dict at a time, tied tensors and odd keys found afterwards by
    one C-level pass each.
    """
    try:
        flat = _flatten(state, plain_keys=True, dedupe=False)
        plain_keys = _SCALARS.issuperset(map(type, flat.keys))
        if plain_keys and len(set(map(id, flat.tensors))) == len(flat.tensors):
            return flat
        # Rare: a tensor met twice (tied weights, stored once) or a key JSON
        # cannot round-trip as it is (a tuple, an enum: encoded like values).
        return _flatten(state, plain_keys=plain_keys, dedupe=True)
    except _Unsupported as exc:
        where = _path_to(state, exc.obj) or "state"
        raise CheckpointError(
            f"{where} is a {type(exc.obj).__qualname__}; state may hold only tensors, "
            "numbers, strings, bytes, None, dtypes, devices and dicts/lists/tuples of them"
        ) from None


def _flatten(state: Any, *, plain_keys: bool, dedupe: bool) -> FlatState:
    flat = FlatState([], [], [], [])
    token, leaf, tensors, add_keys = (
        flat.shape.append,
        flat.leaves.append,
        flat.tensors,
        flat.keys.extend,
    )
    memo: dict[int, int] | None = {} if dedupe else None

    # Ordered by how often each kind occurs in a training state, exact types
    # first: this runs for every object of the state after every step.
    def visit(obj: Any) -> None:
        kind = type(obj)
        if kind is torch.Tensor and memo is None:
            token(len(tensors))
            tensors.append(obj)
        elif kind in _SCALARS:
            token("v")
            leaf(obj)
        elif kind is dict and plain_keys:  # visit_map, inlined
            token("d")
            token(len(obj))
            add_keys(obj)
            for value in obj.values():
                visit(value)
        elif kind is list or kind is tuple:
            visit_sequence(obj, "l" if kind is list else "t")
        else:
            visit_other(obj)

    def visit_map(obj: Mapping, marker: str) -> None:
        token(marker if plain_keys else marker.upper())
        token(len(obj))
        if plain_keys:
            add_keys(obj)
            for value in obj.values():
                visit(value)
        else:
            for key, value in obj.items():
                visit(key)
                visit(value)

    def visit_sequence(obj: list | tuple, marker: str) -> None:
        token(marker)
        token(len(obj))
        for value in obj:
            visit(value)

    def visit_other(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            ref = len(tensors) if memo is None else memo.setdefault(id(obj), len(tensors))
            if ref == len(tensors):
                tensors.append(obj)
            token(ref)
        elif isinstance(obj, Mapping):
            visit_map(obj, "o" if isinstance(obj, OrderedDict) else "d")
        elif isinstance(obj, torch.Size):
            token("s")
            token(obj)
        elif isinstance(obj, (list, tuple)):
            visit_sequence(obj, "l" if isinstance(obj, list) else "t")
        elif isinstance(obj, (str, int, float)):  # subclasses: numpy floats, enums
            token("v")
            leaf(obj)
        elif isinstance(obj, (torch.dtype, torch.device)):
            token("y" if isinstance(obj, torch.dtype) else "e")
            token(obj)
        elif isinstance(obj, bytes):
            token("b")
            leaf(base64.b64encode(obj).decode())
        else:
            raise _Unsupported(obj)

    visit(state)
    return flat


def _path_to(state: Any, target: Any, where: str = "state") -> str | None:
    """Where ``target`` sits in ``state``, as ``state['a'][0]``; for error messages only."""
    if state is target:
        return where
    if isinstance(state, Mapping):
        for key, value in state.items():
            found = _path_to(key, target, f"{where} key") or _path_to(
                value, target, f"{where}[{key!r}]"
            )
            if found:
                return found
    elif isinstance(state, (list, tuple)) and not isinstance(state, torch.Size):
        for index, value in enumerate(state):
            found = _path_to(value, target, f"{where}[{index}]")
            if found:
                return found
    return None


def shape_to_json(shape: list[Any]) -> list[Any]:
    """``shape`` with its dtype, device and Size tokens as JSON values."""
    out = list(shape)
    for i, token in enumerate(shape):
        if isinstance(token, torch.dtype):
            out[i] = str(token).removeprefix("torch.")
        elif isinstance(token, (torch.device, torch.Size)):
            out[i] = str(token) if isinstance(token, torch.device) else list(token)
    return out


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r}")
    return dtype


def unflatten_state(
    shape: list[Any], keys: list[Any], leaves: list[Any], tensors: list[torch.Tensor]
) -> Any:
    """The inverse of :func:`flatten_state` (shape as :func:`shape_to_json` wrote it)."""
    tokens, key_stream, leaf_stream = iter(shape), iter(keys), iter(leaves)

    def read() -> Any:
        token = next(tokens)
        if type(token) is int:
            return tensors[token]
        if token == "v":
            return next(leaf_stream)
        if token in ("d", "o", "D", "O"):
            count = next(tokens)
            if token in ("d", "o"):
                names = [next(key_stream) for _ in range(count)]
                items = [(name, read()) for name in names]
            else:
                items = [(read(), read()) for _ in range(count)]
            return OrderedDict(items) if token in ("o", "O") else dict(items)
        if token in ("l", "t"):
            values = [read() for _ in range(next(tokens))]
            return values if token == "l" else tuple(values)
        decoders = {
            "s": lambda: torch.Size(next(tokens)),
            "y": lambda: dtype_from_name(next(tokens)),
            "e": lambda: torch.device(next(tokens)),
            "b": lambda: base64.b64decode(next(leaf_stream)),
        }
        if token not in decoders:
            raise CheckpointError(f"unknown token {token!r} in encoded state")
        return decoders[token]()

    try:
        state = read()
    except (StopIteration, IndexError) as exc:
        raise CheckpointError("encoded state is truncated (tokens, keys or leaves)") from exc
    end = object()
    if any(next(stream, end) is not end for stream in (tokens, key_stream, leaf_stream)):
        raise CheckpointError("encoded state has tokens, keys or leaves left over")
    return state
