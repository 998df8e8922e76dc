"""Per-step snapshots of the training state in node-local shared memory.

In DDP every rank holds the full model and optimizer, so after a failure the
survivors' state is newer than any disk checkpoint; it is lost only because
torchrun restarts their processes. One worker per node therefore copies the
state after each optimizer step into ``/dev/shm``, outside the process, and the
restarted group resumes from the newest copy any node holds.

Layout of the per-run directory (mode 0700)::

    /dev/shm/elastic_train-<uid>-<run_id>/
        slot-0, slot-1   double buffer, preallocated and memory-mapped
        HEAD             {"slot": 0|1, "step": N}, one fixed-width pwrite (see _flip_head)

A save erases the header of the slot HEAD does *not* name, copies the tensor
bytes and the JSON of everything else (``snapshot_layout``), computes a
checksum, writes the header (magic, step, sizes, checksum, fingerprint) and
only then flips HEAD. A process killed at any point leaves HEAD naming a
complete slot; a slot without a header or whose checksum fails is never used.

Every process that opens the directory, reader or writer, first checks it
through one file descriptor opened with ``O_NOFOLLOW``: a directory, owned by
our uid, no access for group or others. Its files are opened relative to that
descriptor, again with ``O_NOFOLLOW``, and must be regular files of our uid.
Anything else is refused (``SnapshotRefusedError``); a damaged or foreign slot
is skipped with a warning naming it, so a restore falls through to the other
slot, a peer's snapshot or the disk instead of failing.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic_train.errors import SnapshotError, SnapshotRefusedError
from elastic_train.log import get_logger
from elastic_train.state.shm_names import SHM_ROOT, snapshot_directory
from elastic_train.state.snapshot_layout import (
    HEADER_BYTES,
    SlotEncoder,
    SlotMapping,
    decode_checked,
    parse_header,
    slot_end,
    sum64,
    verify,
)
from elastic_train.state.state_io import open_owned_file, open_private_directory

__all__ = [
    "SnapshotStats",
    "SnapshotStore",
]

log = get_logger(__name__)

_ZEROS = bytes(HEADER_BYTES)
_GRANULE = 1 << 16  # slot files grow in 64 KiB steps
_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass
class SnapshotStats:
    """One snapshot, measured by the store: everything save() held the caller for."""

    step: int
    seconds: float
    bytes: int


class SnapshotStore:
    """A double-buffered snapshot of one run's state in shared memory."""

    def __init__(
        self,
        run_id: str,
        *,
        fingerprint: str,
        root: str | Path = SHM_ROOT,
        max_bytes: int | None = None,
        is_writer: bool = True,
    ) -> None:
        if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
            raise SnapshotError(
                f"run_id must be 1-128 characters of [A-Za-z0-9_.-], got {run_id!r}"
            )
        self.run_id = run_id
        self.directory = snapshot_directory(root, run_id)
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.is_writer = is_writer
        self.last_stats: SnapshotStats | None = None
        self._maps: dict[int, SlotMapping] = {}
        self._head: tuple[int, int] | None = None  # (slot, step) this writer last flipped to
        self._dir_fd: int | None = None  # the checked directory; every file opens relative to it
        self._lock_fd: int | None = None
        self._head_fd: int | None = None
        self._encoder = SlotEncoder(fingerprint)
        if is_writer:
            self._make_private_directory()

    def _make_private_directory(self) -> None:
        try:
            self.directory.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise SnapshotError(
                f"cannot create snapshot directory {self.directory}: {exc}"
            ) from exc
        if not self._open_directory():
            raise SnapshotError(f"snapshot directory {self.directory} vanished as it was made")
        # mkdir's mode is filtered by the umask (0700 or less), and a kept
        # directory passed the check: neither grants group or others anything.
        os.fchmod(self._dir_fd, 0o700)  # type: ignore[arg-type]
        # Two writers would flip one HEAD between their slots. The lock dies
        # with its process, so a restarted worker takes it over at once.
        self._lock_fd = self._open("LOCK", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise SnapshotError(
                f"another process writes snapshots to {self.directory}; nodes that share "
                "/dev/shm need distinct run_ids (e.g. f'{run_id}.{node}')"
            ) from exc

    def _open_directory(self) -> bool:
        """Open and check the directory once (``open_private_directory``); False
        where it does not exist (yet). Raises ``SnapshotRefusedError``."""
        if self._dir_fd is None:
            self._dir_fd = open_private_directory(self.directory)
        return self._dir_fd is not None

    def _open(self, name: str, flags: int) -> int:
        return open_owned_file(self._dir_fd, name, flags, where=self.directory)  # type: ignore[arg-type]

    def _file_size(self, name: str) -> int:
        try:
            return os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False).st_size
        except FileNotFoundError:
            return 0

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: dict) -> None:
        """Snapshot ``state`` as ``step`` and publish it; synchronous, one copy of
        the tensor bytes. Raises ``SnapshotError`` when it does not fit or the
        write fails; the previous snapshot stays valid, and the trainer should
        stop snapshotting and rely on disk checkpoints. Non-writers return at once.
        """
        if not self.is_writer:
            return
        start = time.perf_counter()
        slot, end = self._write_slot(step, state)
        try:
            self._flip_head(slot, step)
        except OSError as exc:
            raise SnapshotError(
                f"publishing the snapshot of step {step} in {self.directory} failed: {exc}; "
                "the previous snapshot is intact"
            ) from exc
        self.last_stats = SnapshotStats(step, time.perf_counter() - start, end)

    def _write_slot(self, step: int, state: dict) -> tuple[int, int]:
        """Write a complete slot that HEAD does not name yet; its index and end."""
        encoded = self._encoder.encode(state)
        if self._head is None:
            self._head = self._read_head()
        current = self._head
        slot = 1 - current[0] if current else 0
        blob_start = HEADER_BYTES + encoded.data_bytes
        end = slot_end(encoded.data_bytes, len(encoded.blob))
        try:
            mapping = self._slot_for_write(slot, end, active=current[0] if current else None)
            with torch.no_grad():
                # One call for all tensors: a Python loop of copy_ cost as much as the bytes.
                torch._foreach_copy_(mapping.targets_for(encoded.table), encoded.tensors)
            mapping.mm[blob_start:end] = encoded.blob.ljust(end - blob_start, b"\0")
            digest = sum64(mapping.region[HEADER_BYTES:end])
            mapping.mm[:HEADER_BYTES] = self._encoder.header(step, encoded, digest)
        except OSError as exc:
            log.error("snapshot_write_failed", step=step, error=str(exc), errno=exc.errno)
            raise SnapshotError(
                f"writing the snapshot of step {step} to {self.directory} failed: {exc}; "
                "the previous snapshot is intact"
            ) from exc
        return slot, end

    def _check_fits(self, size: int, *, active: int | None) -> None:
        active_size = self._file_size(_slot_name(active)) if active is not None else 0
        reusable = self._file_size(_slot_name(1 - active if active is not None else 0))
        vfs = os.fstatvfs(self._dir_fd)  # type: ignore[arg-type]
        available = vfs.f_bavail * vfs.f_frsize + reusable
        if self.max_bytes is not None:
            available = min(available, self.max_bytes - active_size)
        if size > available:
            limit = f", max_bytes={self.max_bytes}" if self.max_bytes is not None else ""
            raise SnapshotError(
                f"a snapshot needs {size / 2**20:.1f} MiB but only {available / 2**20:.1f} MiB "
                f"is available under {self.directory} (free space of {self.directory.parent}"
                f"{limit}); snapshots need room for two copies of the state: enlarge "
                "/dev/shm (Kubernetes: an emptyDir with medium: Memory) or turn snapshots off"
            )

    def _slot_for_write(self, slot: int, needed: int, *, active: int | None) -> SlotMapping:
        """The slot's mapping with its header erased (from here on the slot is invalid)."""
        cached = self._maps.get(slot)
        if cached is not None and len(cached.mm) >= needed:
            # The steady state: pages already allocated, nothing to ask the kernel.
            cached.mm[:HEADER_BYTES] = _ZEROS
            return cached
        # Slack for a skeleton that grows a little (longer numbers) from step to step.
        size = -(-(needed + needed // 16) // _GRANULE) * _GRANULE
        self._check_fits(size, active=active)
        return self._map_slot(slot, size)

    def _map_slot(self, slot: int, size: int) -> SlotMapping:
        """A fresh mapping of the slot, header erased first, every page allocated."""
        fd = self._open(_slot_name(slot), os.O_RDWR | os.O_CREAT)
        try:
            if os.fstat(fd).st_size >= HEADER_BYTES:
                os.pwrite(fd, _ZEROS, 0)
            self._unmap(slot)
            os.ftruncate(fd, size)
            # Allocate every page now: touching an unallocated tmpfs page when
            # /dev/shm is full is a SIGBUS, fallocate is a clean ENOSPC.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
            self._maps[slot] = SlotMapping(mm, torch.frombuffer(mm, dtype=torch.uint8))
            return self._maps[slot]
        finally:
            os.close(fd)

    def _unmap(self, slot: int) -> None:
        mapping = self._maps.pop(slot, None)
        if mapping is not None:
            mm = mapping.mm
            del mapping  # the tensor view must go before the mapping can close
            mm.close()

    def _flip_head(self, slot: int, step: int) -> None:
        # A fixed-width record written over the previous one: one syscall where
        # a rename costs four, and a kill cannot tear a write this small (it
        # completes inside the syscall). Readers never race the writer: they
        # read at a (re)start, before the new writer's first save.
        if self._head_fd is None:
            self._head_fd = self._open("HEAD", os.O_WRONLY | os.O_CREAT)
        os.pwrite(self._head_fd, f'{{"slot": {slot}, "step": {step:20d}}}\n'.encode(), 0)
        self._head = (slot, step)

    # ----------------------------------------------------------------- loading

    def _read_head(self) -> tuple[int, int] | None:
        try:
            fd = self._open("HEAD", os.O_RDONLY)
        except FileNotFoundError:
            return None
        except (OSError, SnapshotError) as exc:  # ELOOP: a symlink
            log.warning("snapshot_refused", path=str(self.directory / "HEAD"), reason=str(exc))
            return None
        try:
            head = json.loads(os.pread(fd, 4096, 0))
            slot, step = head["slot"], head["step"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("snapshot_head_unreadable", path=str(self.directory), error=str(exc))
            return None
        finally:
            os.close(fd)
        return (slot, step) if slot in (0, 1) and isinstance(step, int) else None

    def _read_slot(self, slot: int) -> tuple[dict[str, Any], mmap.mmap]:
        """(header, bytes) of a complete slot whose checksums and fingerprint verify.

        The bytes are a private (copy-on-write) mapping: verifying and decoding
        a slot copies nothing but the decoded tensors.
        """
        name = str(self.directory / _slot_name(slot))
        try:
            fd = self._open(_slot_name(slot), os.O_RDONLY)
        except OSError as exc:
            raise SnapshotError(f"{name}: unreadable ({exc})") from exc
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise SnapshotError(f"{name}: no header (torn or never completed)")
            raw = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        except OSError as exc:
            raise SnapshotError(f"{name}: unreadable ({exc})") from exc
        finally:
            os.close(fd)
        header, _ = verify(raw, fingerprint=self.fingerprint, name=name)
        return header, raw

    def _newest_valid(self, *, below: int | None = None) -> tuple[dict[str, Any], mmap.mmap] | None:
        """The newest verified published slot, of a step below ``below`` when given.

        HEAD names the current slot; the other one is a fallback only if it is
        older. A newer one was written but its save died before publishing it,
        so no one vouched for it: it is never used.
        """
        try:
            if not self._open_directory():
                return None
        except SnapshotRefusedError as exc:
            log.warning("snapshot_refused", path=str(self.directory), reason=str(exc))
            return None
        head = self._read_head()
        if head is None:
            return None
        current, published = head
        for slot in (current, 1 - current):
            try:
                header, raw = self._read_slot(slot)
            except SnapshotError as exc:
                log.warning("snapshot_refused", slot=slot, reason=str(exc))
                continue
            if slot != current and header["step"] >= published:
                log.warning("snapshot_slot_uncommitted", slot=slot, step=header["step"])
                continue
            if below is None or header["step"] < below:
                return header, raw
        return None

    def latest_step(self) -> int | None:
        """The step of the newest complete, checksum-verified snapshot on this node."""
        found = self._newest_valid()
        return found[0]["step"] if found else None

    def load(
        self, *, map_location: str | torch.device, step: int | None = None
    ) -> tuple[int, dict] | None:
        """``(step, state)`` of the newest valid snapshot here (of ``step`` when
        given), or None; never a torn, damaged or foreign one. A slot that
        verifies but does not decode is skipped like a damaged one."""
        below = None if step is None else step + 1
        while (found := self._newest_valid(below=below)) is not None:
            header, raw = found
            if step is not None and header["step"] != step:
                return None
            try:
                state = decode_checked(
                    raw, header, name=str(self.directory), map_location=map_location
                )
            except SnapshotError as exc:
                log.warning("snapshot_refused", step=header["step"], reason=str(exc))
                below = header["step"]
                continue
            log.info("snapshot_loaded", step=header["step"], path=str(self.directory))
            return header["step"], state
        return None

    def copy_published(self, *, min_step: int, attempts: int = 5) -> tuple[dict, bytearray]:
        """(header, bytes) of a private copy of the published slot, of a step >= ``min_step``.

        For a reader that runs while the writer goes on saving (the node
        agent's persister): the writer may refill the slot during the copy, so
        the copy is verified afterwards (checksum, and the live header still
        the copied one) and retried on the newer slot. Read with ``pread``, not
        a mapping: a slot file that a restarted writer shrinks would be a SIGBUS.
        Raises ``SnapshotError``.
        """
        if not self._open_directory():
            raise SnapshotError(f"{self.directory}: no snapshot directory")
        problem = "no published snapshot"
        for _ in range(attempts):
            head = self._read_head()
            if head is None:
                break
            if head[1] < min_step:
                problem = f"the published snapshot is step {head[1]}, older than {min_step}"
                break
            try:
                header, raw = self._copy_slot(head[0])
            except SnapshotError as exc:
                problem = str(exc)
                continue
            if header["step"] >= min_step:
                return header, raw
            problem = f"slot-{head[0]} holds step {header['step']}, older than {min_step}"
        raise SnapshotError(f"{self.directory}: cannot copy step >= {min_step}: {problem}")

    def _copy_slot(self, slot: int) -> tuple[dict[str, Any], bytearray]:
        name = self.directory / _slot_name(slot)
        fd = self._open(_slot_name(slot), os.O_RDONLY)
        try:
            first = os.pread(fd, HEADER_BYTES, 0)
            try:
                _, end, _ = parse_header(first)
            except (ValueError, KeyError, TypeError) as exc:
                raise SnapshotError(f"{name}: being rewritten ({exc})") from exc
            raw = bytearray(end)
            view, done = memoryview(raw), 0
            while done < end and (count := os.preadv(fd, [view[done:]], done)):
                done += count
            if done < end:
                raise SnapshotError(f"{name}: {done} of {end} bytes (shrunk while copied)")
            header, _ = verify(raw, fingerprint=self.fingerprint, name=str(name))
            if os.pread(fd, HEADER_BYTES, 0) != bytes(raw[:HEADER_BYTES]):
                raise SnapshotError(f"{name}: rewritten while it was copied")
            return header, raw
        except OSError as exc:
            raise SnapshotError(f"{name}: unreadable ({exc})") from exc
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Delete this run's snapshots (at run completion)."""
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        log.info("snapshot_removed", path=str(self.directory))

    def close(self) -> None:
        """Release the mappings and the writer lock; the snapshot stays for the next restart."""
        for slot in list(self._maps):
            self._unmap(slot)
        if self._head_fd is not None:
            os.close(self._head_fd)
            self._head_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None


def _slot_name(slot: int) -> str:
    return f"slot-{slot}"
