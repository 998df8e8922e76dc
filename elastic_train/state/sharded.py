"""``ShardedCheckpointManager``: checkpoints of an FSDP2 model through
``torch.distributed.checkpoint`` (DCP), loadable at any world size.

Layout under ``directory``::

    step-000000120/
        __0_0.distcp ...       each rank's shards of the model and optimizer (DCP)
        .metadata              DCP's index of the shards
        state.pt               rank 0: everything else (sampler, RNG, schedule,
                               the optimizer's param_groups), weights_only
        MANIFEST.json          format, fingerprint, size and crc32 of every file

Every rank saves its own shards (a collective on a dedicated gloo group, so an
asynchronous save's collectives in a background thread never interleave with
the training's on the default group: torchtitan does the same). The save
goes to ``.tmp-step-...``; once DCP's save has returned (its coordinator
wrote ``.metadata`` after every rank reported its files written), rank 0
writes ``state.pt`` and the manifest, fsyncs and renames the directory to
``step-N``: the commit. Only a directory with a manifest counts, so a failure
at any point leaves the previous checkpoints as they were.

Asynchronous saves use ``dcp.async_save``: it copies the tensors to host
memory before it returns (measured: a tensor changed right after the call is
saved with its old value) and writes them in its own thread; the commit runs
on this manager's writer thread once that write is done.

Loading (:meth:`load`, every rank together) verifies the manifest and the
checksums of all files (each rank a share of them, agreed by one all-reduce)
before DCP reads anything, reads ``.metadata`` with a restricted unpickler
(``dcp_io.VerifiedReader``) and gives DCP only tensors, so nothing is
unpickled beyond checkpoint metadata types. DCP reshards: the state dict it
fills is the current model's, sharded over the current world.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

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
    MANIFEST,
    STATE_FILE,
    checksum_file,
    load_state,
    move_aside,
    put_back,
    remove_stale_temporaries,
    write_manifest,
    write_state,
)
from elastic_train.state.dcp_io import (
    FORMAT,
    VerifiedReader,
    fill_tensors,
    key_difference,
    marked_keys,
    read_dcp_manifest,
    shared_token,
    split_tensors,
    verify_files,
)
from elastic_train.state.state_io import copy_to_host, fsync_path

log = get_logger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
_SHARDED = ("model", "optimizer")


class ShardedCheckpointManager:
    """DCP checkpoints of ``model`` and ``optimizer``; every rank is a writer."""

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int,
        fingerprint: str,
        async_save: bool = True,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        timeout_seconds: float = 60.0,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"checkpoint.keep must be an integer >= 1, got {keep!r}")
        self.directory = Path(directory)
        self.keep, self.fingerprint, self.async_save = keep, fingerprint, async_save
        self.model, self.optimizer = model, optimizer
        #: Every rank writes its shards; rank 0 also commits (``coordinator``).
        self.is_writer = True
        self.coordinator = dist.get_rank() == 0
        self.consecutive_failures = 0
        self.total_failures = 0
        self.last_error: CheckpointWriteError | None = None
        self.loaded_metadata: dict[str, Any] | None = None
        # A collective: every rank builds the manager at the same point of build().
        # The training group's timeout, not new_group's 30 min: a save whose peer
        # died must fail as soon as a step would.
        timeout = timedelta(seconds=timeout_seconds)
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        self._token = shared_token(self._group)
        self._saves = 0
        self._inflight: Future[None] | None = None
        self._writer: ThreadPoolExecutor | None = None
        if self.coordinator:
            self.directory.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(self.directory)
        dist.barrier(group=self._group)  # no rank writes before the stale ones are gone

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: dict, *, blocking: bool = False) -> None:
        """Checkpoint ``state`` as step ``step`` (every rank, together).

        ``state["model"]``/``["optimizer"]`` are replaced by the sharded state
        dicts of the bound model and optimizer. Blocking or synchronous: a
        failed write raises ``CheckpointWriteError``; asynchronous: it is
        logged and counted (:meth:`raise_if_failing`).
        """
        started = time.perf_counter()
        self.flush()
        from torch.distributed.checkpoint.state_dict import get_state_dict

        tensors: dict[str, torch.Tensor] = {}
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        rest = {k: v for k, v in state.items() if k not in _SHARDED}
        rest["model"] = split_tensors(model_state, ["model"], tensors)
        rest["optimizer"] = split_tensors(optim_state, ["optimizer"], tensors)
        rest = copy_to_host(rest) if self.coordinator else None  # rank 0 writes it
        self._saves += 1
        temporary = self.directory / f".tmp-step-{step:09d}-{self._token}-{self._saves}"
        problem = self._prepare(temporary)
        if problem is not None:
            error = self._count_failure(step, problem)
            if blocking or not self.async_save:
                raise error
            return
        writing = self._start_dcp(tensors, temporary, step, asynchronous=not blocking)
        args = (step, temporary, writing, rest, self._metadata(step))
        if blocking or not self.async_save:
            self._finish(*args)
        else:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="dcp-commit")
            self._inflight = self._writer.submit(self._finish_in_background, *args)
        metrics.checkpoint_blocked(time.perf_counter() - started)

    def _prepare(self, temporary: Path) -> BaseException | None:
        """Create the temporary directory; a failure on any rank fails the save on
        every rank alike (one all-reduce), before DCP's collectives begin."""
        problem: BaseException | None = None
        try:
            temporary.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            problem = exc
        failed = torch.tensor([0 if problem is None else 1])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self._group)
        if problem is None and int(failed.item()):
            problem = RuntimeError("a peer could not create the temporary directory")
        return problem

    def _start_dcp(
        self, tensors: dict, temporary: Path, step: int, *, asynchronous: bool
    ) -> Future[Any] | BaseException | None:
        """DCP's save of the shards: its future (async), or the error (sync)."""
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(str(temporary))
        try:
            if asynchronous and self.async_save:
                return dcp.async_save(tensors, storage_writer=writer, process_group=self._group)  # type: ignore[return-value]
            dcp.save(tensors, storage_writer=writer, process_group=self._group)
        except Exception as exc:  # DCP raises CheckpointException on every rank alike
            return exc
        return None

    def _finish_in_background(self, *args: Any) -> None:
        try:
            self._finish(*args)
        except CheckpointWriteError:
            pass  # logged and counted by _finish
        except Exception as exc:  # a bug must not vanish in a thread
            log.exception("checkpoint_writer_crashed", step=args[0])
            self._count_failure(args[0], exc)

    def _finish(self, step: int, temporary: Path, writing: Any, rest: Any, metadata: dict) -> None:
        """Wait for DCP, then (rank 0) write ``state.pt`` and the manifest and commit."""
        started = time.perf_counter()
        try:
            if isinstance(writing, BaseException):
                raise writing
            if writing is not None:
                writing.result()
            if self.coordinator:
                size = self._commit(step, temporary, rest, metadata)
        except Exception as exc:
            if self.coordinator:
                shutil.rmtree(temporary, ignore_errors=True)
            raise self._count_failure(step, exc) from exc
        self.consecutive_failures = 0
        if self.coordinator:
            seconds = time.perf_counter() - started
            metrics.checkpoint_saved(step=step, seconds=seconds, bytes_written=size)
            log.info("checkpoint_saved", step=step, path=str(self._step_dir(step)),
                     bytes=size, seconds=round(seconds, 4), format=FORMAT)  # fmt: skip
            self._prune(step)

    def _commit(self, step: int, temporary: Path, rest: Any, metadata: dict) -> int:
        files = write_state(temporary, rest)
        for path in sorted(temporary.iterdir()):
            if path.name != STATE_FILE:
                size, crc = checksum_file(path)
                files[path.name] = {"crc32": crc, "bytes": size}
                fsync_path(path)
        body = {"format": FORMAT, "step": step, "fingerprint": self.fingerprint,
                "files": files, "metadata": metadata}  # fmt: skip
        write_manifest(temporary, body)
        fsync_path(temporary)
        final = self._step_dir(step)
        replaced = move_aside(final)  # a re-save of this step (after a fallback)
        try:
            os.rename(temporary, final)  # the commit
            fsync_path(self.directory)
        except OSError:
            put_back(final, replaced)
            raise
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        return sum(int(entry["bytes"]) for entry in files.values())

    def flush(self) -> None:
        """Wait for the in-flight asynchronous save, if any."""
        if self._inflight is not None:
            self._inflight.result()
            self._inflight = None

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def raise_if_failing(self, max_consecutive_failures: int) -> None:
        if self.consecutive_failures >= max_consecutive_failures:
            raise CheckpointWriteError(
                f"{self.consecutive_failures} checkpoint saves in a row failed "
                f"(limit checkpoint.max_consecutive_failures={max_consecutive_failures}); "
                f"last error: {self.last_error}"
            )

    def _metadata(self, step: int) -> dict[str, Any]:
        return {
            "step": step, "world_size": dist.get_world_size(), "wall_time": time.time(),
            "versions": {"torch": torch.__version__, "python": sys.version.split()[0],
                         "elastic_train": elastic_train.__version__},
        }  # fmt: skip

    def _count_failure(self, step: int, exc: BaseException) -> CheckpointWriteError:
        self.consecutive_failures += 1
        self.total_failures += 1
        metrics.checkpoint_failed()
        error = CheckpointWriteError(
            f"saving checkpoint step {step} under {self.directory} failed: {exc}; "
            "the previous checkpoints are untouched"
        )
        self.last_error = error
        log.error("checkpoint_write_failed", step=step, error=str(exc),
                  consecutive_failures=self.consecutive_failures)  # fmt: skip
        return error

    def _prune(self, saved_step: int) -> None:
        """Keep the newest ``keep`` checkpoints up to the one just written."""
        older = [(s, p) for s, p in self._step_dirs() if s <= saved_step]
        complete = [(s, p) for s, p in older if (p / MANIFEST).exists()]
        doomed = complete[self.keep :] + [(s, p) for s, p in older if (s, p) not in complete]
        for step, path in doomed:
            try:
                (path / MANIFEST).unlink(missing_ok=True)  # first: never complete-looking
                shutil.rmtree(path)
            except OSError as exc:
                log.warning("checkpoint_prune_failed", step=step, path=str(path), error=str(exc))

    # ----------------------------------------------------------------- loading

    def _step_dir(self, step: int) -> Path:
        return self.directory / f"step-{step:09d}"

    def _step_dirs(self) -> list[tuple[int, Path]]:
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir()
                 if (m := _STEP_DIR.match(p.name)) and p.is_dir()]  # fmt: skip
        return sorted(found, reverse=True)

    def latest_step(self) -> int | None:
        steps = self.loadable_steps(limit=1)
        return steps[0] if steps else None

    def loadable_steps(self, *, limit: int) -> list[int]:
        """Up to ``limit`` newest steps whose manifest verifies and whose file sizes match."""
        found: list[int] = []
        for step, path in self._step_dirs():
            try:
                body = read_dcp_manifest(path, step)
                for name, entry in body["files"].items():
                    if (path / name).stat().st_size != entry["bytes"]:
                        raise CheckpointCorruptError(f"{path / name}: truncated")
            except (CheckpointCorruptError, OSError) as exc:
                log.warning("checkpoint_fallback", step=step, path=str(path), reason=str(exc))
                continue
            found.append(step)
            if len(found) == limit:
                break
        return found

    def load(self, step: int, *, map_location: str | torch.device) -> dict:
        """Load checkpoint ``step`` into the model and optimizer (every rank together)
        and return the whole state, with ``model``/``optimizer`` as their own
        ``state_dict()`` after the load."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        started = time.perf_counter()
        path = self._step_dir(step)
        body = read_dcp_manifest(path, step)
        if body["fingerprint"] != self.fingerprint:
            raise CheckpointMismatchError(
                f"checkpoint {path} was written by a run with config fingerprint "
                f"{body['fingerprint']!r}, but this run's fingerprint is {self.fingerprint!r}: "
                "use a new checkpoint directory or restore the original config"
            )
        verify_files(path, body, self._group)
        rest = load_state(path, body, map_location="cpu")
        template: dict[str, torch.Tensor] = {}
        current = get_state_dict(self.model, self.optimizer)
        for name, part in zip(_SHARDED, current, strict=True):
            split_tensors(part, [name], template)
        saved = marked_keys(rest["model"]) | marked_keys(rest["optimizer"])
        if saved != set(template):
            raise CheckpointMismatchError(
                f"checkpoint {path} holds other tensors than this model and optimizer "
                f"({key_difference(saved, set(template))}): a checkpoint from another model"
            )
        self._read_shards(template, path)
        set_state_dict(
            self.model, self.optimizer,
            model_state_dict=fill_tensors(rest["model"], template),
            optim_state_dict=fill_tensors(rest["optimizer"], template),
        )  # fmt: skip
        rest["model"], rest["optimizer"] = self.model.state_dict(), self.optimizer.state_dict()
        self.loaded_metadata = body["metadata"]
        metrics.checkpoint_loaded(step=step, seconds=time.perf_counter() - started,
                                  saved_at=body["metadata"]["wall_time"])  # fmt: skip
        log.info("checkpoint_loaded", step=step, path=str(path), format=FORMAT,
                 saved_world_size=body["metadata"]["world_size"])  # fmt: skip
        return rest

    def _read_shards(self, template: dict[str, torch.Tensor], path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        try:
            dcp.load(template, storage_reader=VerifiedReader(str(path)), process_group=self._group)
        except CheckpointCorruptError:
            raise
        except Exception as exc:  # DCP's CheckpointException, raised on every rank alike
            raise CheckpointCorruptError(f"{path}: DCP could not load it ({exc})") from exc
