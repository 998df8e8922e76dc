"""The files of one checkpoint directory: the state and its manifest, written and verified.

The state is one of two files. ``state.pt`` is ``torch.save`` of the state
(the trainer writer). ``state.slot`` (format 3) is a snapshot slot's bytes as
they are (``snapshot_layout``: tensor bytes, JSON structure, a sum64 checksum
in a header that carries a crc32 of itself): the node agent's writer copies
the slot to disk without decoding or re-serializing it, and reading it back
unpickles nothing at all.

The manifest lists each file's size and checksum. New checkpoints use crc32
(zlib, about 6 GB/s here against 1.8 GB/s for sha256): it is there to catch a
torn or flipped write, not an attacker, who could rewrite the manifest too;
what keeps a hostile file from running code is ``torch.load(weights_only=True)``.
Manifests written with sha256 (format 1) still load.

A load verifies ``state.pt`` through one file descriptor, reading it in
chunks, and then memory-maps the same inode (:func:`load_state`)
through ``/proc/self/fd``: no second copy of the file in memory, and a file
renamed over it after the check is not the one loaded.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
import stat
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from elastic_train.errors import CheckpointCorruptError, CheckpointMismatchError, SnapshotError
from elastic_train.log import get_logger
from elastic_train.state.snapshot_layout import ALGORITHM as SLOT_CHECKSUM
from elastic_train.state.snapshot_layout import decode_checked, verify
from elastic_train.state.state_io import map_tensors, new_hasher, save_hashed

MANIFEST = "MANIFEST.json"
STATE_FILE = "state.pt"
SLOT_FILE = "state.slot"
FORMAT = "elastic_train.checkpoint/2"
#: Format 3: the state is ``state.slot``; older readers refuse it by its format.
SLOT_FORMAT = "elastic_train.checkpoint/3"
#: Format 1 differs only in its sha256 file checksums.
READABLE_FORMATS = ("elastic_train.checkpoint/1", FORMAT, SLOT_FORMAT)
_STATE_FILES = ({STATE_FILE}, {SLOT_FILE})
#: Manifests of sharded checkpoints (``sharded.py``), which this reader refuses by name.
_DCP_FORMATS = "elastic_train.dcp/"
FILE_CHECKSUM = "crc32"
_KNOWN_CHECKSUMS = ("crc32", "sha256")
_CHUNK = 8 << 20  # verify in 8 MiB reads: never the whole file in memory
#: An older copy of a checkpoint moved aside while the same step is saved again.
_ASIDE = re.compile(r"^\.tmp-step-replaced-(step-\d+)-[0-9a-f]{8}$")

log = get_logger(__name__)


def manifest_checksum(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_state(directory: Path, state: Any) -> dict[str, dict[str, Any]]:
    """``torch.save`` into ``directory/state.pt``, checksummed as it is written, fsynced."""
    with open(directory / STATE_FILE, "wb") as file:
        digest, size = save_hashed(state, file, algorithm=FILE_CHECKSUM)
        file.flush()
        os.fsync(file.fileno())
    return {STATE_FILE: {FILE_CHECKSUM: digest, "bytes": size}}


def write_slot(directory: Path, raw: bytearray, *, digest: str) -> dict[str, dict[str, Any]]:
    """Write a verified snapshot slot's bytes as ``directory/state.slot``, fsynced;
    ``digest``: the slot header's sum64, which the manifest binds to the file."""
    fd = os.open(directory / SLOT_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view, done = memoryview(raw), 0
        while done < len(raw):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return {SLOT_FILE: {SLOT_CHECKSUM: digest, "bytes": len(raw)}}


def state_file(body: Mapping[str, Any]) -> str:
    """The name of the state file a verified manifest lists."""
    return next(iter(body["files"]))


def write_manifest(directory: Path, body: Mapping[str, Any]) -> None:
    """Write and fsync ``directory/MANIFEST.json`` (the directory itself is the caller's)."""
    document = json.dumps({"body": body, "sha256": manifest_checksum(body)}).encode()
    fd = os.open(directory / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        written = os.write(fd, document)
        if written != len(document):
            raise OSError(f"short write of {MANIFEST}: {written} of {len(document)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(directory: Path, step: int) -> dict[str, Any]:
    """The verified manifest body of a checkpoint directory."""
    try:
        document = json.loads((directory / MANIFEST).read_bytes())
        body = document["body"]
        valid = document["sha256"] == manifest_checksum(body)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(
            f"{directory / MANIFEST}: unreadable manifest ({exc})"
        ) from exc
    if valid and str(body.get("format", "")).startswith(_DCP_FORMATS):
        raise CheckpointMismatchError(
            f"{directory} is a {body['format']!r} checkpoint (training.parallel = 'fsdp2'); "
            "a training.parallel = 'ddp' job cannot read it: use a new checkpoint.dir, "
            "or parallel = 'fsdp2'"
        )
    if not valid or body.get("format") not in READABLE_FORMATS or body.get("step") != step:
        raise CheckpointCorruptError(f"{directory / MANIFEST}: manifest fails its checksum")
    if set(body.get("files", {})) not in _STATE_FILES:
        raise CheckpointCorruptError(f"{directory / MANIFEST}: unexpected file list")
    return body


def _open_verified(directory: Path, body: Mapping[str, Any]) -> tuple[int, os.stat_result]:
    """A descriptor of ``state.pt`` and its ``fstat``, once its size and checksum match
    the manifest. The caller loads through this descriptor and closes it."""
    entry = body["files"][STATE_FILE]
    algorithm = next((name for name in _KNOWN_CHECKSUMS if name in entry), None)
    if algorithm is None:
        raise CheckpointCorruptError(
            f"{directory / MANIFEST}: no checksum for {STATE_FILE} "
            f"(expected one of {', '.join(_KNOWN_CHECKSUMS)})"
        )
    path = directory / STATE_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointCorruptError(f"{path}: unreadable ({exc})") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != entry["bytes"]:
            raise CheckpointCorruptError(
                f"{path}: {info.st_size} bytes but the manifest says {entry['bytes']} (truncated?)"
            )
        if _file_checksum(fd, algorithm) != entry[algorithm]:
            raise CheckpointCorruptError(f"{path}: {algorithm} does not match the manifest")
    except OSError as exc:
        os.close(fd)
        raise CheckpointCorruptError(f"{path}: unreadable ({exc})") from exc
    except CheckpointCorruptError:
        os.close(fd)
        raise
    return fd, info


def _file_checksum(fd: int, algorithm: str) -> str:
    hasher, offset = new_hasher(algorithm), 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    while count := os.preadv(fd, [buffer], offset):
        hasher.update(view[:count])
        offset += count
    return hasher.hexdigest()


def checksum_file(path: Path, algorithm: str = FILE_CHECKSUM) -> tuple[int, str]:
    """``(size, checksum)`` of one file, read in chunks (OSError if unreadable)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.fstat(fd).st_size, _file_checksum(fd, algorithm)
    finally:
        os.close(fd)


def _unchanged(before: os.stat_result, after: os.stat_result) -> bool:
    """Whether two ``fstat`` results of one file show no write between them."""
    fields = ("st_ino", "st_dev", "st_size", "st_mtime_ns", "st_ctime_ns")
    return all(getattr(before, name) == getattr(after, name) for name in fields)


def load_state(path: Path, body: dict[str, Any], *, map_location: str | torch.device) -> dict:
    """``torch.load(weights_only=True, mmap=True)`` of the verified ``state.pt``.

    Mapped, the file is never in memory twice (bytes and tensors): the pages
    are the page cache's, which the ranks of a node share. Loaded through the
    descriptor that was verified, so a file renamed over it meanwhile is not
    what gets unpickled, and an in-place write to it in between is detected
    by ``fstat`` (``_unchanged``). Tensors left in host memory are then copied
    out of the mapping: a mapped page read later from a file that rank 0
    has pruned meanwhile would be a SIGBUS on network storage.
    """
    if SLOT_FILE in body["files"]:
        return _load_slot(path, body, map_location=map_location)
    fd, before = _open_verified(path, body)
    source = f"/proc/self/fd/{fd}" if os.path.exists(f"/proc/self/fd/{fd}") else path / STATE_FILE
    try:
        state = torch.load(source, map_location=map_location, weights_only=True, mmap=True)
        changed = not _unchanged(before, os.fstat(fd))
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, ...
        raise CheckpointCorruptError(f"{path / STATE_FILE}: refused by torch.load ({exc})") from exc
    finally:
        os.close(fd)
    if changed:
        raise CheckpointCorruptError(f"{path / STATE_FILE}: changed while it was loaded")
    return map_tensors(
        state, lambda tensor: tensor.clone() if tensor.device.type == "cpu" else tensor
    )


def _load_slot(
    directory: Path, body: Mapping[str, Any], *, map_location: str | torch.device
) -> Any:
    """The state in ``state.slot``: its size, its sum64 against the manifest and the
    header's own, and the fingerprint checked before anything is decoded.

    The file is mapped (private, copy-on-write) rather than read, as a
    ``state.pt`` is: the restore holds the decoded tensors and the page
    cache's pages, never a second copy of the file in its own memory. An
    ``fstat`` before and after shows a write into the file meanwhile.
    """
    path, entry = directory / SLOT_FILE, body["files"][SLOT_FILE]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode) or before.st_size != entry["bytes"]:
                raise CheckpointCorruptError(
                    f"{path}: {before.st_size} bytes but the manifest says {entry['bytes']} "
                    "(truncated?)"
                )
            # Unmapped with its last reference, not closed: a traceback may hold
            # a tensor view of it, and closing an exported mapping raises.
            raw = mmap.mmap(fd, before.st_size, access=mmap.ACCESS_COPY)
            state = _decode_slot(raw, body, path=path, map_location=map_location)
            changed = not _unchanged(before, os.fstat(fd))
        finally:
            os.close(fd)
    except (OSError, ValueError) as exc:  # mmap raises ValueError for an empty file
        raise CheckpointCorruptError(f"{path}: unreadable ({exc})") from exc
    if changed:
        raise CheckpointCorruptError(f"{path}: changed while it was loaded")
    return state


def _decode_slot(
    raw: mmap.mmap, body: Mapping[str, Any], *, path: Path, map_location: str | torch.device
) -> Any:
    try:
        header, _ = verify(raw, fingerprint=body["fingerprint"], name=str(path))
        digest = body["files"][SLOT_FILE].get(SLOT_CHECKSUM)
        if header[SLOT_CHECKSUM] != digest or header["step"] != body["step"]:
            raise CheckpointCorruptError(f"{path}: its header does not match the manifest")
        return decode_checked(raw, header, name=str(path), map_location=map_location)
    except SnapshotError as exc:
        raise CheckpointCorruptError(str(exc)) from exc


# ------------------------------------------- replacing and removing step directories


def move_aside(final: Path) -> Path | None:
    """Rename an older copy of this step away; it is deleted once the new one is complete."""
    if not final.exists():
        return None
    aside = final.parent / f".tmp-step-replaced-{final.name}-{uuid.uuid4().hex[:8]}"
    os.rename(final, aside)
    return aside


def put_back(final: Path, replaced: Path | None) -> None:
    """After a failed save, put back the older copy of the same step, if one was moved."""
    if replaced is None or (final / MANIFEST).exists():
        return
    try:
        if final.exists():
            shutil.rmtree(final)
        os.rename(replaced, final)
    except OSError as exc:
        log.warning("checkpoint_restore_failed", path=str(replaced), error=str(exc))


def delete_checkpoint(path: Path) -> None:
    # Manifest first: an interrupted delete must not leave something complete-looking.
    (path / MANIFEST).unlink(missing_ok=True)
    try:  # what we wrote, without rmtree's walk; anything else there takes the walk
        for name in (STATE_FILE, SLOT_FILE):
            (path / name).unlink(missing_ok=True)
        path.rmdir()
    except OSError:
        shutil.rmtree(path)


def remove_stale_temporaries(directory: Path) -> None:
    """Remove what dead saves left, but put back a complete checkpoint that a
    re-save had moved aside (:func:`move_aside`) when it died before its commit."""
    for path in directory.glob(".tmp-step-*"):
        aside = _ASIDE.match(path.name)
        final = directory / aside.group(1) if aside else None
        if final is not None and (path / MANIFEST).exists() and not final.exists():
            try:
                os.rename(path, final)
                log.warning("checkpoint_replace_undone", path=str(final))
                continue
            except OSError as exc:
                log.warning("checkpoint_restore_failed", path=str(path), error=str(exc))
        shutil.rmtree(path, ignore_errors=True)
