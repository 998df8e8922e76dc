"""FSDP2 (``training.parallel = "fsdp2"``): torch's ``fully_shard`` in the loop.

:func:`shard_model` shards the model right after it is built, before the
optimizer sees its parameters (``fully_shard`` replaces them with sharded
``DTensor`` parameters): every element of the outermost ``nn.ModuleList`` or
``nn.Sequential`` containers that holds parameters (a transformer's blocks)
gets its own ``fully_shard``, then the root. :func:`wrap_for_training` gives the
step what DDP gives it (a callable module with ``no_sync``), and
:func:`open_checkpoints` picks the checkpoint manager: the DCP one
(``state/sharded.py``) for a sharded model, so a job saved at world N resumes
at world M. :func:`node_snapshots` turns per-step snapshots off for fsdp2:
a snapshot is one node's copy of the whole state, and a sharded state is
spread over every node (docs/training.md, "FSDP2").

At the end, rank 0 measures the final loss and writes the final parameters
on an unsharded copy of the model (:func:`consolidate`), taken before the
sharding (on the CPU) and filled from the gathered full state, so the finish
code reads plain tensors as it does under DDP.
"""

from __future__ import annotations

import copy
import inspect
import os
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic_train.config.job import JobConfig, TrainingConfig
from elastic_train.errors import ConfigError
from elastic_train.log import get_logger
from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.state.persist import SOCKET_ENV as PERSIST_SOCKET_ENV
from elastic_train.state.persist import AgentCheckpointManager
from elastic_train.state.sharded import ShardedCheckpointManager
from elastic_train.training.distributed import DistContext, WorkerEnv
from elastic_train.training.state_sync import NodeSnapshots, open_snapshots

if TYPE_CHECKING:
    from elastic_train.training.loop import Trainer

log = get_logger(__name__)

#: DDP's ``init_sync`` (torch >= 2.7): whether its constructor may skip its collectives.
_DDP_INIT_SYNC = "init_sync" in inspect.signature(DistributedDataParallel.__init__).parameters

#: Rank 0's unsharded copy of each sharded model, for the finish (:func:`consolidate`).
_BLUEPRINTS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or the module ``torch.compile`` wraps) went through fully_shard."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(getattr(model, "_orig_mod", model), FSDPModule)


def shard_blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of the outermost ModuleList/Sequential containers that hold parameters."""
    blocks: list[nn.Module] = []
    pending = [model]
    while pending:
        module = pending.pop()
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            blocks.extend(c for c in module.children() if next(c.parameters(), None) is not None)
        else:
            pending.extend(module.children())
    return blocks


def shard_model(model: nn.Module, cfg: TrainingConfig, ctx: DistContext) -> nn.Module:
    """``fully_shard`` the blocks, then the root, over all ranks; DDP: ``model`` as it is."""
    if is_sharded(model):  # the finish needs rank 0's copy from before the sharding
        raise ConfigError(
            "the model is already sharded (fully_shard): pass the plain model and set "
            "training.parallel = 'fsdp2', which shards it"
        )
    if cfg.parallel != "fsdp2":
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    blueprint = copy.deepcopy(model).to("cpu") if ctx.is_main else None
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    blocks = shard_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if blueprint is not None:
        _BLUEPRINTS[model] = blueprint
    log.info("fsdp2_sharded", blocks=len(blocks), world_size=ctx.world_size)
    return model


class ShardedModel(nn.Module):
    """What the step calls for a sharded model: DDP's ``forward`` and ``no_sync``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module  # possibly torch.compile's wrapper of the sharded model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> _NoSync:
        """Accumulate unsharded gradients without a reduce-scatter (DDP's ``no_sync``)."""
        return _NoSync(getattr(self.module, "_orig_mod", self.module))


class _NoSync:
    def __init__(self, sharded: Any) -> None:
        self.sharded = sharded

    def __enter__(self) -> None:
        self.sharded.set_requires_gradient_sync(False)

    def __exit__(self, *exc_info: object) -> None:
        self.sharded.set_requires_gradient_sync(True)


def wrap_for_training(
    model: nn.Module, ctx: DistContext, *, states_equal: bool = False
) -> nn.Module:
    """DDP around a plain model (its constructor broadcasts rank 0's weights);
    :class:`ShardedModel` around a sharded one.

    ``states_equal``: every rank holds the same weights already (an in-process
    re-form has just brought them all to one state), so DDP's start-up
    collectives (a shape check and a broadcast of every parameter) are skipped
    where torch can (``init_sync``, torch >= 2.7): milliseconds of the members'
    stall at a join. Buffers still follow rank 0 from the first forward on."""
    if is_sharded(model):
        return ShardedModel(model)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    if states_equal and _DDP_INIT_SYNC:
        return DistributedDataParallel(model, device_ids=device_ids, init_sync=False)
    return DistributedDataParallel(model, device_ids=device_ids)


def open_checkpoints(
    cfg: JobConfig,
    ctx: DistContext,
    *,
    fingerprint: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> CheckpointManager | ShardedCheckpointManager | None:
    """The checkpoint manager for this model; None when ``checkpoint.dir`` is empty."""
    if not cfg.checkpoint.dir:
        return None
    if is_sharded(model):
        if cfg.checkpoint.writer == "agent" and ctx.is_main:  # "auto" means this quietly
            log.info("checkpoint_writer_fallback", writer="trainer", reason="fsdp2 (no snapshots)")
        return ShardedCheckpointManager(
            cfg.checkpoint.dir, keep=cfg.checkpoint.keep, fingerprint=fingerprint,
            async_save=cfg.checkpoint.async_save, model=model, optimizer=optimizer,
            timeout_seconds=cfg.elastic.pg_timeout_seconds,
        )  # fmt: skip
    socket_path = os.environ.get(PERSIST_SOCKET_ENV, "")
    if cfg.checkpoint.writer == "agent" and ctx.is_main and not socket_path:
        log.info("checkpoint_writer_fallback", writer="trainer",
                 reason=f"no node agent persister ({PERSIST_SOCKET_ENV} unset: not under torchrun "
                        "with the etcd-v3 rendezvous)")  # fmt: skip
    if cfg.checkpoint.writer == "trainer" or not socket_path:
        return CheckpointManager(
            cfg.checkpoint.dir, keep=cfg.checkpoint.keep, fingerprint=fingerprint,
            async_save=cfg.checkpoint.async_save, is_writer=ctx.is_main,
        )  # fmt: skip
    manager = AgentCheckpointManager(
        cfg.checkpoint.dir, keep=cfg.checkpoint.keep, fingerprint=fingerprint,
        async_save=cfg.checkpoint.async_save, is_writer=ctx.is_main, socket_path=socket_path,
        chosen=cfg.checkpoint.writer == "agent",
    )  # fmt: skip
    # node_snapshots() is called next, with this ctx.env: it attaches its store.
    _AWAITING_SNAPSHOTS[id(ctx.env)] = manager
    return manager


#: Agent-writer managers waiting for their node's snapshots, by id of the WorkerEnv.
_AWAITING_SNAPSHOTS: dict[int, AgentCheckpointManager] = {}


def node_snapshots(cfg: JobConfig, env: WorkerEnv, *, fingerprint: str) -> NodeSnapshots | None:
    """This node's per-step snapshots; none for fsdp2, which relies on its DCP checkpoints.

    With the agent writer the checkpoint manager that :func:`open_checkpoints`
    made for this env gets the store (:func:`attach_snapshots`): it persists
    from it (without one it writes itself, ``checkpoint_writer_fallback``).
    """
    snapshots = None
    if cfg.training.parallel != "fsdp2":
        snapshots = open_snapshots(cfg.elastic, env, fingerprint=fingerprint)
    elif cfg.elastic.snapshot:
        log.info("snapshot_off", reason="training.parallel = 'fsdp2'", fallback="disk")
    attach_snapshots(env, snapshots)
    return snapshots


def attach_snapshots(env: WorkerEnv, snapshots: NodeSnapshots | None) -> None:
    """Give the agent-writer manager that :func:`open_checkpoints` last made for ``env``
    the node's snapshot store: at the start, and at an in-process re-form that
    made this worker rank 0 (its snapshots outlive the re-form; its manager is new)."""
    manager = _AWAITING_SNAPSHOTS.pop(id(env), None)
    if manager is not None and snapshots is not None and snapshots.enabled:
        manager.attach(snapshots.store, snapshots.hold)


def consolidate(t: Trainer) -> Trainer:
    """Before the finish (every rank): gather the full parameters and give rank 0
    an unsharded model holding them, so the final loss and the result files
    read plain tensors without collectives. DDP: ``t`` unchanged."""
    if not is_sharded(t.model):
        return t
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(t.model, options=options)  # a collective
    blueprint = _BLUEPRINTS.get(t.model)
    if blueprint is not None:
        blueprint.load_state_dict(full)
        t.model = blueprint.to(t.ctx.device)
    return t
