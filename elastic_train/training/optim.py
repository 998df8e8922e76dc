"""Batch size, optimizer and learning-rate schedule from the configuration.

``optimizer.name`` and ``schedule.name`` name a built-in (AdamW or SGD; a
warmup then constant, cosine or linear multiplier) or import a user factory:
``optimizer(model, **optimizer.options) -> torch.optim.Optimizer`` (any
optimizer, any parameter groups) and ``scheduler(optimizer, **schedule.options)
-> LRScheduler``. A factory that is not callable, raises, or returns the wrong
thing is a ConfigError naming the key, raised when the trainer is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from elastic_train.config.job import (
    BUILTIN_OPTIMIZERS,
    BUILTIN_SCHEDULES,
    JobConfig,
    OptimizerConfig,
    ScheduleConfig,
    TrainingConfig,
)
from elastic_train.errors import ConfigError
from elastic_train.log import get_logger
from elastic_train.workload.registry import import_string

log = get_logger(__name__)

OPTIMIZER_CONTRACT = (
    f"optimizer.name takes {', '.join(BUILTIN_OPTIMIZERS)} or an import string "
    "package.module:factory of factory(model, **optimizer.options) -> torch.optim.Optimizer"
)
SCHEDULE_CONTRACT = (
    f"schedule.name takes {', '.join(BUILTIN_SCHEDULES)} or an import string "
    "package.module:factory of factory(optimizer, **schedule.options) -> "
    "torch.optim.lr_scheduler.LRScheduler, stepped once per optimizer step"
)
#: The same contracts for the factories a script hands to elastic_train.api.fit.
FIT_OPTIMIZER_CONTRACT = (
    "fit(optimizer=...) takes factory(model) -> torch.optim.Optimizer over the "
    "parameters of the model it is given (any optimizer, any parameter groups)"
)
FIT_SCHEDULE_CONTRACT = (
    "fit(scheduler=...) takes factory(optimizer) -> torch.optim.lr_scheduler.LRScheduler "
    "of the optimizer it is given, stepped once per optimizer step"
)


#: Where ``optimizer.implementation = "auto"`` picks fused AdamW.
FUSED_DEVICES = ("cpu", "cuda")


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


def _call_factory(source: str, contract: str, factory: Callable[..., Any],
                  *args: Any, **options: Any) -> Any:  # fmt: skip
    try:
        return factory(*args, **options)
    except Exception as exc:
        raise ConfigError(
            f"{source}: the factory raised {type(exc).__name__}: {exc}; {contract}"
        ) from exc


def checked_optimizer(
    source: str,
    factory: Callable[..., Any],
    model: nn.Module,
    *,
    contract: str = OPTIMIZER_CONTRACT,
    options: Mapping[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """``factory(model, **options)``, checked; ``source`` names it in errors
    (``optimizer.name = '...'``, or ``fit(optimizer=...)`` for a script's)."""
    optimizer = _call_factory(source, contract, factory, model, **(options or {}))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"{source}: the factory returned a {type(optimizer).__name__}, not a "
            f"torch.optim.Optimizer; {contract}"
        )
    _check_optimized_parameters(source, optimizer, model, contract)
    return optimizer


def build_optimizer(cfg: OptimizerConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.name not in BUILTIN_OPTIMIZERS:
        factory = import_string(cfg.name, field="optimizer.name")
        source = f"optimizer.name = {cfg.name!r}"
        return checked_optimizer(source, factory, model, options=cfg.options)
    params = list(model.parameters())
    kernel = _kernel(cfg, params)
    try:
        if cfg.name == "sgd":
            return torch.optim.SGD(
                params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **kernel
            )
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
            weight_decay=cfg.weight_decay, **kernel,
        )  # fmt: skip
    except (RuntimeError, ValueError) as exc:  # torch's refusal of a kernel for these tensors
        raise ConfigError(
            f"optimizer.implementation = {cfg.implementation!r}: torch refused it for "
            f"{cfg.name} on these parameters ({exc}); accepted: auto, for-loop, foreach, fused"
        ) from exc


def _kernel(cfg: OptimizerConfig, params: list[torch.Tensor]) -> dict[str, bool]:
    """torch's keyword for ``optimizer.implementation``. Fused AdamW does a step in
    one kernel instead of a dozen per tensor: on CPU, where torch's default is the
    per-tensor loop, a 76 k-parameter MLP's step took 150-220 µs instead of 420-460."""
    if cfg.implementation == "for-loop":
        return {"foreach": False}
    if cfg.implementation == "foreach":
        return {"foreach": True}
    if cfg.implementation == "fused":
        # torch 2.13 checks only at the first step, past this boundary.
        devices = _get_fused_kernels_supported_devices()
        refused = {f"{p.dtype} on {p.device.type}" for p in params
                   if not (p.is_floating_point() and p.device.type in devices)}  # fmt: skip
        if refused:
            raise ConfigError(
                f"optimizer.implementation = 'fused': torch has no fused {cfg.name} kernel "
                f"for parameters of {', '.join(sorted(refused))} (it has one for floating "
                f"point on {', '.join(devices)}); accepted: auto, for-loop, foreach, fused"
            )
        return {"fused": True}
    fusable = cfg.name == "adamw" and all(
        type(p.data) is torch.Tensor and p.is_floating_point() and p.device.type in FUSED_DEVICES
        for p in params
    )  # an FSDP2 shard is a DTensor
    return {"fused": True} if fusable else {}


def clip_grad_norm(model: nn.Module, max_norm: float) -> None:
    """``nn.utils.clip_grad_norm_(model.parameters(), max_norm)``. For CPU gradients of
    one dtype it takes one norm over all of them and one scale, where torch loops
    over the tensors on CPU: bitwise the same gradients, 50 µs instead of 82 on the
    benchmark MLP. Anything else (CUDA, FSDP2's DTensors, sparse) is torch's."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    plain_cpu = all(
        type(g) is torch.Tensor and g.device.type == "cpu" and g.layout == torch.strided
        and g.dtype == grads[0].dtype
        for g in grads
    )  # fmt: skip
    if not grads or not plain_cpu:
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))


def _check_optimized_parameters(
    source: str, optimizer: torch.optim.Optimizer, model: nn.Module, contract: str
) -> None:
    """Every optimized tensor must be one of the model's parameters (the ones
    DDP synchronises and the checkpoint saves); a trainable parameter left out
    is legal but usually a mistake in the parameter groups, so it is logged."""
    owned = {id(p): name for name, p in model.named_parameters()}
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not optimized <= owned.keys():
        raise ConfigError(
            f"{source}: the optimizer holds {len(optimized - owned.keys())} "
            f"tensors that are not parameters of the model it was given; {contract}"
        )
    left_out = [name for key, name in owned.items() if key not in optimized]
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    missed = [name for name in left_out if name in trainable]
    if missed:
        log.warning("optimizer_misses_parameters", count=len(missed), names=missed[:10])


def build_scheduler(
    cfg: JobConfig, optimizer: torch.optim.Optimizer, *, total: int, world_size: int
) -> LRScheduler:
    if cfg.schedule.name not in BUILTIN_SCHEDULES:
        return _user_scheduler(cfg, optimizer)
    # The classic per-worker mode scales the LR linearly with the world size. The
    # factor lives in the lambda, not in the saved state, so it follows resizes.
    scale = world_size if cfg.training.batch_mode == "per_worker" else 1
    return LambdaLR(optimizer, lambda step: scale * lr_multiplier(cfg.schedule, step, total=total))


def _user_scheduler(cfg: JobConfig, optimizer: torch.optim.Optimizer) -> LRScheduler:
    spec = cfg.schedule.name
    factory = import_string(spec, field="schedule.name")
    return checked_scheduler(
        f"schedule.name = {spec!r}", factory, optimizer, batch_mode=cfg.training.batch_mode,
        options=cfg.schedule.options,
    )  # fmt: skip


def checked_scheduler(
    source: str,
    factory: Callable[..., Any],
    optimizer: torch.optim.Optimizer,
    *,
    batch_mode: str,
    contract: str = SCHEDULE_CONTRACT,
    options: Mapping[str, Any] | None = None,
) -> LRScheduler:
    """``factory(optimizer, **options)``, checked; ``source`` names it in errors."""
    scheduler = _call_factory(source, contract, factory, optimizer, **(options or {}))
    problem = None
    if isinstance(scheduler, ReduceLROnPlateau):
        problem = "a ReduceLROnPlateau, which needs a metric at every step"
    elif not isinstance(scheduler, LRScheduler):
        problem = f"a {type(scheduler).__name__}, not a torch.optim.lr_scheduler.LRScheduler"
    elif scheduler.optimizer is not optimizer:
        problem = "a scheduler of another optimizer than the one it was given"
    if problem is not None:
        raise ConfigError(f"{source}: the factory returned {problem}; {contract}")
    if batch_mode == "per_worker":
        # Only the built-in schedules scale the LR with the world size.
        log.warning("per_worker_lr_not_scaled", schedule=source)
    return scheduler


def restore_learning_rates(optimizer: torch.optim.Optimizer, scheduler: LRScheduler) -> None:
    """After a restore: the built-in schedule's LR at this world size.

    The optimizer comes back with the LR of the old world size (per_worker
    mode scales it); the built-in ``LambdaLR`` recomputes it. A user's
    scheduler keeps the LR its state and the optimizer's state restored.
    """
    if not isinstance(scheduler, LambdaLR):
        return
    for group, lr_lambda, base in zip(
        optimizer.param_groups, scheduler.lr_lambdas, scheduler.base_lrs, strict=True
    ):
        group["lr"] = base * lr_lambda(scheduler.last_epoch)
