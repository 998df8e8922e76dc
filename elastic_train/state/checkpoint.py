"""``CheckpointManager``: atomic, verified, asynchronous checkpoints on disk.

Layout under ``directory``::

    step-000000120/            one directory per checkpoint
        state.pt               torch.save of the host copy of the state, or
        state.slot             the node's snapshot slot as it is (the agent writer)
        MANIFEST.json          checksum + size of the state file, fingerprint, metadata
    .tmp-step-000000140-ab12   a save in progress (never read)

A save writes ``state.pt`` and then the manifest (see ``checkpoint_files``)
into a temporary directory, fsyncs both files and the directory, renames the
directory to its final name and fsyncs the parent: four fsyncs, and the rename
is the commit. A crash at any point therefore leaves either a temporary
directory (removed by the next writer) or a complete checkpoint; a step
directory without a manifest (an older layout's crash, or foreign) is never
loaded. The manifest carries a checksum of itself, so a bit flip in it is seen
as corruption and not as, say, a different fingerprint.

Asynchronous saves copy the state into host buffers kept from the previous
save (``staging.HostStaging``) and queue the write on one long-lived writer
thread. One set of buffers, not two: a save first waits for the previous write
(as it always has: one save in flight at most), so the writer never reads a
buffer that is being refilled, and a second set would only cost memory.

Loading verifies the manifest and the checksum of the bytes *before* they reach
``torch.load(weights_only=True)``, so a file that is not one of our checkpoints
is never unpickled at all; the verified file is then memory-mapped, not read
into memory a second time (``checkpoint_files.load_state``). A ``state.slot``
is verified the same way and decoded from tensor bytes and JSON: nothing in
it is unpickled at all. The ranks of a
group do not each pick their newest checkpoint: ``restore.restore_newest``
agrees on one step and each rank calls :meth:`CheckpointManager.load` with it.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import elastic_train
from elastic_train import metrics
from elastic_train.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointWriteError,
    ConfigError,
)
from elastic_train.log import get_logger
from elastic_train.state.checkpoint_files import (
    FORMAT,
    MANIFEST,
    SLOT_FORMAT,
    delete_checkpoint,
    load_state,
    move_aside,
    put_back,
    read_manifest,
    remove_stale_temporaries,
    state_file,
    write_manifest,
    write_slot,
    write_state,
)
from elastic_train.state.staging import HostStaging
from elastic_train.state.state_io import copy_to_host, fsync_path

__all__ = [
    "CheckpointManager",
    "SaveStats",
]

log = get_logger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class SaveStats:
    """Timings of one save, measured by the manager itself (seconds)."""

    step: int
    wait_seconds: float  # waiting for the previous in-flight save
    copy_seconds: float  # the deep copy of the state to host memory
    blocked_seconds: float = 0.0  # everything save() held the caller for
    write_seconds: float | None = None  # serialize + fsync + rename + manifest
    bytes: int = 0


class CheckpointManager:
    """Saves and loads verified checkpoints; only ``is_writer`` (rank 0) writes."""

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int,
        fingerprint: str,
        async_save: bool = True,
        is_writer: bool,
        remove_temporaries: bool = True,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"checkpoint.keep must be an integer >= 1, got {keep!r}")
        self.directory = Path(directory)
        self.keep = keep
        self.fingerprint = fingerprint
        self.async_save = async_save
        self.is_writer = is_writer
        #: Saves that failed since the last one that succeeded.
        self.consecutive_failures = 0
        self.total_failures = 0
        self.last_error: CheckpointWriteError | None = None
        self.last_save_stats: SaveStats | None = None
        #: The manifest metadata of the checkpoint the last load returned.
        self.loaded_metadata: dict[str, Any] | None = None
        self._inflight: Future[None] | None = None
        # Created on the first asynchronous save; its one thread writes every save.
        self._writer: ThreadPoolExecutor | None = None
        self._staging = HostStaging() if async_save else None
        self._closed = False
        if is_writer:
            self.directory.mkdir(parents=True, exist_ok=True)
            if remove_temporaries:  # False: another process may be writing here now
                remove_stale_temporaries(self.directory)

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: dict, *, blocking: bool = False) -> None:
        """Checkpoint ``state`` as step ``step``.

        Returns once the state is copied to host memory, unless ``blocking`` or
        the manager is synchronous; then a failed write raises
        ``CheckpointWriteError``. A failed asynchronous write is logged and
        counted in ``consecutive_failures`` (see :meth:`raise_if_failing`).
        Non-writer ranks return at once.
        """
        if self._closed:
            raise RuntimeError("CheckpointManager.save() after close()")
        if not self.is_writer:
            return
        start = time.perf_counter()
        self.flush()
        copied_at = time.perf_counter()
        # A synchronous manager keeps no staging memory between saves.
        host_state = copy_to_host(state) if self._staging is None else self._staging.copy(state)
        stats = SaveStats(step, copied_at - start, time.perf_counter() - copied_at)
        self.last_save_stats = stats
        args = (step, host_state, self._metadata(step), stats)
        try:
            if blocking or not self.async_save:
                self._write(*args)
            else:
                self._inflight = self._submit(args)
        finally:
            stats.blocked_seconds = time.perf_counter() - start
            metrics.checkpoint_blocked(stats.blocked_seconds)

    def write_slot(
        self, step: int, raw: bytearray, *, digest: str, metadata: dict[str, Any]
    ) -> None:
        """Write a verified snapshot slot's bytes (``digest``: its header's sum64) as
        checkpoint ``step`` here and now: the node agent's persister
        (``state/persist.py``), which got the trainer's ``metadata``. Nothing is
        decoded or serialized again. Raises ``CheckpointWriteError`` (logged and counted)."""
        stats = SaveStats(step, 0.0, 0.0)
        self._commit(step, lambda d: write_slot(d, raw, digest=digest), metadata, stats,
                     layout=SLOT_FORMAT)  # fmt: skip

    def _submit(self, args: tuple[Any, ...]) -> Future[None] | None:
        """Queue the write on the writer thread, or write here if threads are over (exit)."""
        if self._writer is None:
            # Its thread is not a daemon: interpreter exit waits for a queued write.
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        try:
            return self._writer.submit(self._write_in_background, *args)
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
            self._write_in_background(*args)
            return None

    def flush(self) -> None:
        """Wait until the in-flight asynchronous save, if any, has finished."""
        if self._inflight is not None:
            self._inflight.result()
            # Cleared only once it is done: the next save must not refill its buffers earlier.
            self._inflight = None

    def close(self) -> None:
        """Flush, stop the writer thread and free the staging buffers."""
        self.flush()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._staging is not None:
            self._staging.release()
        self._closed = True

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def raise_if_failing(self, max_consecutive_failures: int) -> None:
        """Raise ``CheckpointWriteError`` once that many saves in a row have failed."""
        if self.consecutive_failures >= max_consecutive_failures:
            raise CheckpointWriteError(
                f"{self.consecutive_failures} checkpoint saves in a row failed "
                f"(limit checkpoint.max_consecutive_failures={max_consecutive_failures}); "
                f"last error: {self.last_error}"
            )

    def _metadata(self, step: int) -> dict[str, Any]:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        return {
            "step": step,
            "world_size": torch.distributed.get_world_size() if distributed else 1,
            "wall_time": time.time(),
            "versions": {
                "torch": torch.__version__,
                "python": sys.version.split()[0],
                "elastic_train": elastic_train.__version__,
            },
        }

    def _write_in_background(self, *args: Any) -> None:
        try:
            self._write(*args)
        except CheckpointWriteError:
            pass  # logged and counted by _write; the loop polls consecutive_failures
        except Exception as exc:  # a bug must not vanish silently in a thread
            log.exception("checkpoint_writer_crashed", step=args[0])
            self._count_failure(args[0], exc)

    def _write(self, step: int, state: Any, metadata: dict, stats: SaveStats) -> None:
        self._commit(step, lambda d: write_state(d, state), metadata, stats, layout=FORMAT)

    def _commit(
        self,
        step: int,
        write_files: Callable[[Path], dict[str, dict[str, Any]]],
        metadata: dict,
        stats: SaveStats,
        *,
        layout: str,
    ) -> None:
        """``write_files`` into a temporary directory, the manifest, and the rename."""
        started = time.perf_counter()
        temporary = self.directory / f".tmp-step-{step:09d}-{uuid.uuid4().hex[:8]}"
        final = self._step_dir(step)
        replaced: Path | None = None
        try:
            temporary.mkdir()
            files = write_files(temporary)
            self._write_manifest(temporary, step, files, metadata, layout=layout)
            fsync_path(temporary)
            replaced = move_aside(final)
            os.rename(temporary, final)  # the commit: the directory arrives complete
            fsync_path(self.directory)
        except (OSError, RuntimeError) as exc:
            shutil.rmtree(temporary, ignore_errors=True)
            put_back(final, replaced)
            raise self._count_failure(step, exc) from exc
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        stats.write_seconds = time.perf_counter() - started
        stats.bytes = sum(entry["bytes"] for entry in files.values())
        self.consecutive_failures = 0
        seconds = stats.copy_seconds + stats.write_seconds
        metrics.checkpoint_saved(step=step, seconds=seconds, bytes_written=stats.bytes)
        log.info(
            "checkpoint_saved",
            step=step,
            path=str(final),
            bytes=stats.bytes,
            seconds=round(stats.write_seconds, 4),
            copy_seconds=round(stats.copy_seconds, 4),
        )
        self._prune(step)

    def _write_manifest(
        self, temporary: Path, step: int, files: dict, metadata: dict, *, layout: str
    ) -> None:
        body = {
            "format": layout,
            "step": step,
            "fingerprint": self.fingerprint,
            "files": files,
            "metadata": metadata,
        }
        write_manifest(temporary, body)

    def _count_failure(self, step: int, exc: BaseException) -> CheckpointWriteError:
        self.consecutive_failures += 1
        self.total_failures += 1
        metrics.checkpoint_failed()
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        error = CheckpointWriteError(
            f"saving checkpoint step {step} under {self.directory} failed: {reason}; "
            "the previous checkpoints are untouched"
        )
        self.last_error = error
        log.error(
            "checkpoint_write_failed",
            step=step,
            error=reason,
            errno=getattr(exc, "errno", None),
            consecutive_failures=self.consecutive_failures,
        )
        return error

    def _prune(self, saved_step: int) -> None:
        """Keep the newest ``keep`` complete checkpoints up to the one just written.

        Newer directories (from a timeline abandoned by a fallback) are left
        alone: they are replaced when training reaches their step again.
        """
        older = [(s, p, (p / MANIFEST).exists()) for s, p in self._step_dirs() if s <= saved_step]
        complete = [(s, p) for s, p, done in older if done]
        doomed = complete[self.keep :] + [(s, p) for s, p, done in older if not done]
        for step, path in doomed:
            try:
                delete_checkpoint(path)
            except OSError as exc:
                log.warning("checkpoint_prune_failed", step=step, path=str(path), error=str(exc))

    # ----------------------------------------------------------------- loading

    def _step_dir(self, step: int) -> Path:
        return self.directory / f"step-{step:09d}"

    def _step_dirs(self) -> list[tuple[int, Path]]:
        """Checkpoint directories, newest step first."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found, reverse=True)

    def latest_step(self) -> int | None:
        """The newest checkpoint whose manifest verifies and whose file sizes match.

        An in-flight save is not included; ``flush()`` first for that. The
        checksum of the data is checked by the load itself.
        """
        steps = self.loadable_steps(limit=1)
        return steps[0] if steps else None

    def loadable_steps(self, *, limit: int) -> list[int]:
        """Up to ``limit`` newest steps whose manifest verifies and whose sizes match,
        newest first: what this rank reports to the restore agreement."""
        found: list[int] = []
        for step, path in self._step_dirs():
            try:
                body = read_manifest(path, step)
                name = state_file(body)
                size = (path / name).stat().st_size
            except (CheckpointCorruptError, OSError) as exc:
                incomplete = not (path / MANIFEST).exists()
                reason = "incomplete" if incomplete else str(exc)
                log.warning("checkpoint_fallback", step=step, path=str(path), reason=reason)
                continue
            if size != body["files"][name]["bytes"]:
                log.warning("checkpoint_fallback", step=step, path=str(path), reason="truncated")
                continue
            found.append(step)
            if len(found) == limit:
                break
        return found

    def load_latest(self, *, map_location: str | torch.device) -> tuple[int, dict] | None:
        """``(step, state)`` of the newest good checkpoint, or None if there is none.

        Incomplete or corrupt checkpoints are skipped with a ``checkpoint_fallback``
        warning. A checkpoint from another config raises ``CheckpointMismatchError``.
        For one process only: ranks of a group agree on a step first
        (``restore.restore_newest``) and then each calls :meth:`load`.
        """
        for step, path in self._step_dirs():
            if not (path / MANIFEST).exists():
                log.warning("checkpoint_fallback", step=step, path=str(path), reason="incomplete")
                continue
            try:
                return step, self.load(step, map_location=map_location)
            except CheckpointCorruptError as exc:
                log.warning("checkpoint_fallback", step=step, path=str(path), reason=str(exc))
        return None

    def load(self, step: int, *, map_location: str | torch.device) -> dict:
        """The state of checkpoint ``step``, verified before anything is unpickled.

        Raises ``CheckpointCorruptError`` (damaged, unreadable) or
        ``CheckpointMismatchError`` (another config's).
        """
        started = time.perf_counter()
        path = self._step_dir(step)
        body = read_manifest(path, step)
        if body["fingerprint"] != self.fingerprint:
            raise CheckpointMismatchError(
                f"checkpoint {path} was written by a run with config fingerprint "
                f"{body['fingerprint']!r}, but this run's fingerprint is {self.fingerprint!r}: "
                "a field that must not change across a resume differs; use a new "
                "checkpoint directory or restore the original config"
            )
        state = load_state(path, body, map_location=map_location)
        self.loaded_metadata = body["metadata"]
        metrics.checkpoint_loaded(
            step=step, seconds=time.perf_counter() - started, saved_at=body["metadata"]["wall_time"]
        )
        log.info(
            "checkpoint_loaded",
            step=step,
            path=str(path),
            saved_world_size=body["metadata"]["world_size"],
        )
        return state
