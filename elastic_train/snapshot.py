"""Per-step snapshots of the training state in node-local shared memory.

In DDP every rank holds the full model and optimizer, so after a failure the
survivors' state is newer than any disk checkpoint; it is lost only because
torchrun restarts their processes. One worker per node therefore copies the
state after each optimizer step into ``/dev/shm``, outside the process, and the
restarted group resumes from the newest copy any node holds.

Layout of the per-run directory (mode 0700)::

    /dev/shm/elastic_train-<uid>-<run_id>/
        slot-0, slot-1   double buffer: a 512-byte header, then torch.save bytes
        HEAD             {"slot": 0|1, "step": N}, replaced atomically

A save truncates the slot HEAD does *not* name (which erases its header),
writes the data, then the header (magic, step, size, crc32, fingerprint) and
only then flips HEAD with a rename. A process killed at any point leaves HEAD
naming a complete slot; a slot whose header is missing or whose checksum fails
is never used.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from elastic_train.errors import SnapshotError
from elastic_train.log import get_logger
from elastic_train.state_io import checksum, copy_to_host, save_hashed

log = get_logger(__name__)

HEADER_BYTES = 512
MAGIC = b"ETSNAP1\n"
ALGORITHM = "crc32"  # detects torn writes; tmpfs has no bit rot to guard against
_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
# torch.save adds a few hundred bytes per tensor plus the pickle; be generous.
_OVERHEAD_PER_TENSOR = 1024
_OVERHEAD = 1 << 20


@dataclass
class SnapshotStats:
    """Timings of one snapshot (seconds), measured by the store."""

    step: int
    copy_seconds: float  # host copy on the caller's thread (0 for a blocking save)
    blocked_seconds: float = 0.0  # everything save() held the caller for
    write_seconds: float | None = None  # serialize + checksum + header + HEAD flip
    bytes: int = 0


def _state_nbytes(state: Any) -> tuple[int, int]:
    """(bytes of tensor data, number of tensors) in a nested state."""
    seen: dict[int, int] = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            seen[id(obj)] = obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value)

    visit(state)
    return sum(seen.values()), len(seen)


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class SnapshotStore:
    """A double-buffered snapshot of one run's state in shared memory."""

    def __init__(
        self,
        run_id: str,
        *,
        fingerprint: str,
        root: str | Path = "/dev/shm",
        max_bytes: int | None = None,
        is_writer: bool = True,
    ) -> None:
        if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
            raise SnapshotError(
                f"run_id must be 1-128 characters of [A-Za-z0-9_.-], got {run_id!r}"
            )
        self.directory = Path(root) / f"elastic_train-{os.getuid()}-{run_id}"
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.is_writer = is_writer
        self.last_stats: SnapshotStats | None = None
        self._inflight: threading.Thread | None = None
        self._pending_error: SnapshotError | None = None
        if is_writer:
            self._make_private_directory()

    def _make_private_directory(self) -> None:
        try:
            self.directory.mkdir(mode=0o700, parents=False, exist_ok=True)
            info = self.directory.lstat()
        except OSError as exc:
            raise SnapshotError(
                f"cannot create snapshot directory {self.directory}: {exc}"
            ) from exc
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise SnapshotError(f"{self.directory} exists but is not a directory owned by us")
        # mkdir's mode is filtered by the umask and ignored for an existing directory.
        os.chmod(self.directory, 0o700)

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: dict, *, blocking: bool = False) -> None:
        """Snapshot ``state`` as ``step``; raises SnapshotError when it cannot.

        Asynchronous by default: the caller blocks for the host copy only and a
        thread writes the slot; a new save first waits for the previous one. A
        failure of that thread is raised by the next ``save()`` or ``flush()``.
        ``SnapshotError`` means: stop snapshotting, rely on disk checkpoints.
        """
        if not self.is_writer:
            return
        start = time.perf_counter()
        self.flush()
        self._check_fits(state)
        if blocking:
            stats = SnapshotStats(step, copy_seconds=0.0)
            self.last_stats = stats
            try:
                self._write(step, state, stats)
            finally:
                stats.blocked_seconds = time.perf_counter() - start
            return
        copy_start = time.perf_counter()
        host_state = copy_to_host(state)
        stats = SnapshotStats(step, copy_seconds=time.perf_counter() - copy_start)
        self.last_stats = stats
        self._inflight = threading.Thread(
            target=self._write_in_background,
            args=(step, host_state, stats),
            name=f"snapshot-writer-{step}",
            daemon=True,  # a snapshot is worthless once the process exits
        )
        self._inflight.start()
        stats.blocked_seconds = time.perf_counter() - start

    def flush(self) -> None:
        """Wait for the in-flight snapshot; raise the SnapshotError it ended with, if any."""
        thread, self._inflight = self._inflight, None
        if thread is not None:
            thread.join()
        error, self._pending_error = self._pending_error, None
        if error is not None:
            raise error

    def _check_fits(self, state: dict) -> None:
        nbytes, tensors = _state_nbytes(state)
        needed = nbytes + tensors * _OVERHEAD_PER_TENSOR + _OVERHEAD
        current = self._read_head()
        active = _file_size(self._slot_path(current[0])) if current else 0
        reusable = _file_size(self._slot_path(1 - current[0] if current else 0))
        vfs = os.statvfs(self.directory)
        available = vfs.f_bavail * vfs.f_frsize + reusable
        if self.max_bytes is not None:
            available = min(available, self.max_bytes - active)
        if needed > available:
            raise SnapshotError(
                f"a snapshot needs about {needed / 2**20:.1f} MiB but only "
                f"{available / 2**20:.1f} MiB is available under {self.directory} "
                f"(free space of {self.directory.parent}"
                + (f", max_bytes={self.max_bytes}" if self.max_bytes is not None else "")
                + "); snapshots need room for two copies of the state: enlarge /dev/shm "
                "(Kubernetes: an emptyDir with medium: Memory) or turn snapshots off"
            )

    def _write_in_background(self, step: int, state: Any, stats: SnapshotStats) -> None:
        try:
            self._write(step, state, stats)
        except SnapshotError as exc:
            self._pending_error = exc
        except Exception as exc:  # a bug must not vanish silently in a thread
            log.exception("snapshot_writer_crashed", step=step)
            self._pending_error = SnapshotError(f"snapshot of step {step} failed: {exc}")

    def _write(self, step: int, state: Any, stats: SnapshotStats) -> None:
        started = time.perf_counter()
        current = self._read_head()
        slot = 1 - current[0] if current else 0
        try:
            with open(self._slot_path(slot), "wb") as file:  # truncation erases the header
                file.write(bytes(HEADER_BYTES))
                digest, size = save_hashed(state, file, algorithm=ALGORITHM)
                file.seek(0)
                file.write(self._header(step, digest, size))
            self._flip_head(slot, step)
        except OSError as exc:
            log.error("snapshot_write_failed", step=step, error=str(exc), errno=exc.errno)
            raise SnapshotError(
                f"writing the snapshot of step {step} to {self.directory} failed: {exc}; "
                "the previous snapshot is intact"
            ) from exc
        stats.write_seconds = time.perf_counter() - started
        stats.bytes = size

    def _header(self, step: int, digest: str, size: int) -> bytes:
        fields = {"step": step, "bytes": size, ALGORITHM: digest, "fingerprint": self.fingerprint}
        header = MAGIC + json.dumps(fields).encode()
        if len(header) > HEADER_BYTES:
            raise SnapshotError(f"snapshot header too long ({len(header)} bytes); fingerprint?")
        return header.ljust(HEADER_BYTES, b" ")

    def _flip_head(self, slot: int, step: int) -> None:
        partial = self.directory / "HEAD.tmp"
        partial.write_text(json.dumps({"slot": slot, "step": step}))
        os.replace(partial, self.directory / "HEAD")

    # ----------------------------------------------------------------- loading

    def _slot_path(self, slot: int) -> Path:
        return self.directory / f"slot-{slot}"

    def _read_head(self) -> tuple[int, int] | None:
        try:
            head = json.loads((self.directory / "HEAD").read_text())
            slot, step = head["slot"], head["step"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("snapshot_head_unreadable", path=str(self.directory), error=str(exc))
            return None
        return (slot, step) if slot in (0, 1) and isinstance(step, int) else None

    def _read_slot(self, slot: int) -> tuple[int, memoryview]:
        """(step, torch.save bytes) of a complete, verified slot."""
        path = self._slot_path(slot)
        try:
            raw = memoryview(path.read_bytes())
        except OSError as exc:
            raise SnapshotError(f"{path}: unreadable ({exc})") from exc
        if bytes(raw[: len(MAGIC)]) != MAGIC:
            raise SnapshotError(f"{path}: no header (torn or never completed)")
        try:
            header = json.loads(bytes(raw[len(MAGIC) : HEADER_BYTES]))
            step, size, digest = header["step"], header["bytes"], header[ALGORITHM]
        except (ValueError, KeyError, TypeError) as exc:
            raise SnapshotError(f"{path}: unreadable header ({exc})") from exc
        data = raw[HEADER_BYTES:]
        if len(data) != size or checksum(data, ALGORITHM) != digest:
            raise SnapshotError(f"{path}: data does not match its header (torn write)")
        if header.get("fingerprint") != self.fingerprint:
            raise SnapshotError(
                f"{path}: written under config fingerprint {header.get('fingerprint')!r}, "
                f"this run's is {self.fingerprint!r}"
            )
        return step, data

    def _newest_valid(self) -> tuple[int, memoryview] | None:
        head = self._read_head()
        if head is None:
            return None
        # HEAD names the current slot; the other one is an older step, used only
        # if the current one is damaged.
        for slot in (head[0], 1 - head[0]):
            try:
                return self._read_slot(slot)
            except SnapshotError as exc:
                log.warning("snapshot_slot_invalid", slot=slot, reason=str(exc))
        return None

    def latest_step(self) -> int | None:
        """The step of the newest complete, checksum-verified snapshot on this node."""
        found = self._newest_valid()
        return found[0] if found else None

    def load(self, *, map_location: str | torch.device) -> tuple[int, dict] | None:
        """``(step, state)`` of the newest valid snapshot here, or None; never a torn one."""
        found = self._newest_valid()
        if found is None:
            return None
        step, data = found
        try:
            state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        except Exception as exc:  # torch raises UnpicklingError, RuntimeError, ...
            raise SnapshotError(f"snapshot of step {step} refused by torch.load: {exc}") from exc
        log.info("snapshot_loaded", step=step, path=str(self.directory))
        return step, state

    def remove(self) -> None:
        """Delete this run's snapshots (at run completion)."""
        with contextlib.suppress(SnapshotError):  # it is being deleted anyway
            self.flush()
        shutil.rmtree(self.directory, ignore_errors=True)
        log.info("snapshot_removed", path=str(self.directory))

    def close(self) -> None:
        """Wait for the in-flight snapshot; the snapshot itself stays for the next restart."""
        self.flush()


# ------------------------------------------------------------ restore agreement


class Agreement(NamedTuple):
    """Where the group resumes from: ``source`` is "snapshot", "disk" or "none"."""

    source: str
    step: int
    owner_rank: int  # a global rank that holds it; -1 for "none"


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def decide(table: torch.Tensor, ranks: list[int]) -> Agreement:
    """The newest state in a ``[world, 2]`` table of (snapshot step, disk step), -1 = none.

    A snapshot wins a tie with the disk (it is already in memory); among ranks
    holding the winner the lowest rank owns it, so every rank decides the same.
    """
    for column, source in ((0, "snapshot"), (1, "disk")):
        best = int(table[:, column].max())
        if best >= 0 and best >= int(table.max()):
            owner = int((table[:, column] == best).nonzero()[0, 0])
            return Agreement(source, best, ranks[owner])
    return Agreement("none", 0, -1)


def agree_on_newest(
    *, local_snapshot_step: int | None, disk_step: int | None, group: dist.ProcessGroup | None
) -> Agreement:
    """Agree, in one all_gather of two integers per rank, on the newest state anyone holds.

    ``local_snapshot_step`` is this node's verified snapshot (``SnapshotStore.latest_step``
    or the step of ``load()``), ``disk_step`` the newest checkpoint this rank can read.
    Without an initialized process group it decides from the local values alone.
    """
    mine = torch.tensor(
        [
            -1 if local_snapshot_step is None else local_snapshot_step,
            -1 if disk_step is None else disk_step,
        ],
        dtype=torch.int64,
    )
    if not (dist.is_available() and dist.is_initialized()):
        return decide(mine.unsqueeze(0), [0])
    device = _collective_device(group)
    gathered = [
        torch.empty(2, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))
    ]
    dist.all_gather(gathered, mine.to(device), group=group)
    ranks = [r if group is None else dist.get_global_rank(group, r) for r in range(len(gathered))]
    agreement = decide(torch.stack(gathered).cpu(), ranks)
    log.info(
        "restore_agreed",
        source=agreement.source,
        step=agreement.step,
        owner_rank=agreement.owner_rank,
    )
    return agreement


def broadcast_state(
    state: dict | None,
    src: int,
    group: dist.ProcessGroup | None,
    *,
    map_location: str | torch.device = "cpu",
) -> dict:
    """Ship ``state`` from global rank ``src`` to every rank of ``group``.

    The state travels as ``torch.save`` bytes in a uint8 tensor (two broadcasts:
    size, then payload) and is read back with ``weights_only=True``, so no
    peer can make us unpickle an arbitrary object. ``src`` gets its own
    ``state`` back; the others pass anything (ignored).
    """
    device = _collective_device(group)
    is_src = dist.get_rank() == src
    if is_src and state is None:
        raise ValueError(f"broadcast_state: the source rank {src} must pass its state")
    if is_src:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    if not is_src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    on_device = payload.to(device)
    dist.broadcast(on_device, src, group=group)
    if is_src:
        return state
    data = bytes(on_device.cpu().untyped_storage())
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
