"""Batch size, optimizer and learning-rate schedule from the configuration."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from elastic_train.config.job import JobConfig, OptimizerConfig, ScheduleConfig, TrainingConfig
from elastic_train.errors import ConfigError


def global_batch_size(cfg: TrainingConfig, world_size: int) -> int:
    """Samples per optimizer step at this world size."""
    if cfg.batch_mode == "per_worker":
        return cfg.worker_batch_size * world_size
    if world_size > cfg.global_batch_size:
        raise ConfigError(
            f"training.global_batch_size = {cfg.global_batch_size} is smaller than the world "
            f"size {world_size}: every worker needs at least one sample per step; raise it "
            "or run fewer workers"
        )
    return cfg.global_batch_size


def total_steps(cfg: TrainingConfig, *, dataset_len: int, batch_size: int) -> int:
    return cfg.steps if cfg.steps > 0 else cfg.epochs * math.ceil(dataset_len / batch_size)


def lr_multiplier(cfg: ScheduleConfig, step: int, *, total: int) -> float:
    """Schedule factor for the LR of optimizer step ``step + 1`` (linear warmup first)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    if cfg.name == "cosine":
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 - (1 - cfg.min_lr_ratio) * progress


def build_optimizer(cfg: OptimizerConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )  # fmt: skip


def build_scheduler(
    cfg: JobConfig, optimizer: torch.optim.Optimizer, *, total: int, world_size: int
) -> LambdaLR:
    # The classic per-worker mode scales the LR linearly with the world size. The
    # factor lives in the lambda, not in the saved state, so it follows resizes.
    scale = world_size if cfg.training.batch_mode == "per_worker" else 1
    return LambdaLR(optimizer, lambda step: scale * lr_multiplier(cfg.schedule, step, total=total))
