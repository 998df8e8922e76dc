"""How a run starts and finishes: ``checkpoint.init_from``, ``checkpoint.resume_from``,
``training.compile`` and ``checkpoint.export_dir`` (docs/training.md, "Start and finish").

The loop calls :func:`prepare_model` in ``build`` right after the model is
made (before the first collective, so a bad ``init_from`` or ``resume_from``
fails every rank alike, with exit code 78), :func:`compiled` where it wraps
the model in DDP, :func:`restore_or_resume_from` in ``restore`` and
:func:`export_final` in ``finish``.

``resume_from`` seeds a run, it never moves one backwards: it is used only
while this run's own state (snapshots and ``checkpoint.dir``) holds no step at
or past it. A restart of a job that has progressed beyond it therefore resumes
the job's newest state (``resume_from_ignored`` is logged), instead of jumping
back and redoing every step since. To roll a run back, start it with a new
``checkpoint.dir`` and ``resume_from`` pointing into the old one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from elastic_train.config.job import JobConfig, TrainingConfig
from elastic_train.errors import CheckpointCorruptError, ConfigError
from elastic_train.log import get_logger
from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.state.checkpoint_files import read_manifest
from elastic_train.state.restore import Restored
from elastic_train.state.weights import export_weights, init_weights, resume_checkpoint
from elastic_train.training.state_sync import NodeSnapshots, restore_state

if TYPE_CHECKING:
    from elastic_train.training.loop import Trainer

log = get_logger(__name__)


def prepare_model(model: nn.Module, cfg: JobConfig) -> None:
    """Load ``init_from``'s weights (checked against the model) and check that
    ``resume_from`` names a complete checkpoint; both before any collective."""
    if cfg.checkpoint.resume_from:
        resume_checkpoint(cfg.checkpoint.resume_from)
    if cfg.checkpoint.init_from:
        init_weights(model, cfg.checkpoint.init_from)


def compiled(model: nn.Module, cfg: TrainingConfig) -> nn.Module:
    """``torch.compile(model)`` when ``training.compile``; DDP wraps what this returns.

    The loop keeps the uncompiled module for state dicts (the compiled wrapper
    would prefix every key with ``_orig_mod.``) and for evaluation; both share
    the parameters, so checkpoints of compiled and uncompiled runs are one format.
    Compilation happens at the first forward of the first step.
    """
    if not cfg.compile:
        return model
    log.info("compile_enabled", mode=cfg.compile_mode)
    return torch.compile(model, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)  # type: ignore[return-value]


def restore_or_resume_from(
    snapshots: NodeSnapshots | None,
    checkpoint: CheckpointManager | None,
    *,
    cfg: JobConfig,
    device: torch.device,
) -> Restored:
    """This run's newest state, or ``checkpoint.resume_from``'s while the run has
    none at or past its step (a collective: every rank decides the same).

    The resumed checkpoint must carry this run's fingerprint (else
    ``CheckpointMismatchError``): a full state only fits the same model and data.
    """
    restored = restore_state(snapshots, checkpoint, device=device)
    source = cfg.checkpoint.resume_from
    if not source:
        return restored
    directory, step = resume_checkpoint(source)
    if restored.source != "none" and restored.step >= step:
        log.info(
            "resume_from_ignored", resume_from=source, resume_from_step=step,
            restored_step=restored.step, source=restored.source,
            reason="this run's own state is at or past it",
        )  # fmt: skip
        return restored
    stores = (checkpoint, snapshots.store if snapshots is not None else None)
    fingerprint = next((s.fingerprint for s in stores if s is not None), None)
    manager = CheckpointManager(
        directory, keep=1, fingerprint=fingerprint or "", async_save=False, is_writer=False
    )
    try:
        if fingerprint is None:  # neither checkpoints nor snapshots: nothing to compare with
            manager.fingerprint = read_manifest(directory / f"step-{step:09d}", step)["fingerprint"]
        state = manager.load(step, map_location=device)
    except CheckpointCorruptError as exc:  # also from read_manifest
        raise ConfigError(f"checkpoint.resume_from = {source!r}: unusable: {exc}") from exc
    log.info("resume_from_loaded", resume_from=source, step=step, own_step=restored.step)
    return Restored("resume_from", step, state)


def export_final(t: Trainer) -> None:
    """Rank 0 writes the final weights into ``checkpoint.export_dir`` ("" : no export)."""
    directory = t.cfg.checkpoint.export_dir
    if not directory or not t.ctx.is_main:
        return
    paths = export_weights(t.model.state_dict(), directory)
    log.info("weights_exported", step=t.step, files=[str(p) for p in paths])
