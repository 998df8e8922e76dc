"""Process-group setup and teardown from the torchrun environment.

torchrun describes each worker with environment variables; outside torchrun
(``python elastic_train/main.py``) none are set and the worker runs as a
single-process group on an in-memory store, so the training code has one path.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_train.config.job import ElasticConfig
from elastic_train.errors import ConfigError
from elastic_train.log import get_logger
from elastic_train.metrics import node_name_from
from elastic_train.training.etcd_access import EtcdAccess

log = get_logger(__name__)

#: An attempt id is 12 hex digits: 48 random bits, which fit an int64 tensor.
_ATTEMPT_ID_MASK = (1 << 48) - 1


@dataclass(frozen=True)
class WorkerEnv:
    """What torchrun tells a worker about itself."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    restart_count: int = 0
    run_id: str = "standalone"
    node: str = "local"
    #: False when started without torchrun (or another launcher setting WORLD_SIZE).
    launched: bool = False


def read_worker_env(environ: Mapping[str, str] = os.environ) -> WorkerEnv:
    """Read ``RANK``, ``WORLD_SIZE``, ... ; a malformed value raises ConfigError naming it."""

    def integer(name: str, default: int) -> int:
        raw = environ.get(name)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None

    env = WorkerEnv(
        rank=integer("RANK", 0),
        local_rank=integer("LOCAL_RANK", 0),
        world_size=integer("WORLD_SIZE", 1),
        local_world_size=integer("LOCAL_WORLD_SIZE", 1),
        restart_count=integer("TORCHELASTIC_RESTART_COUNT", 0),
        run_id=environ.get("TORCHELASTIC_RUN_ID", "standalone"),
        node=node_name_from(environ),
        launched="WORLD_SIZE" in environ,
    )
    if not 0 <= env.rank < env.world_size:
        raise ConfigError(f"RANK={env.rank} is outside WORLD_SIZE={env.world_size}")
    if env.launched and "MASTER_ADDR" not in environ:
        raise ConfigError(
            "WORLD_SIZE is set but MASTER_ADDR is not: start the workers with torchrun "
            "(or another launcher that sets both), or unset WORLD_SIZE to train as one process"
        )
    return env


@dataclass(frozen=True)
class DistContext:
    """The initialized process group as the trainer sees it."""

    env: WorkerEnv
    backend: str
    device: torch.device

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def choose_backend(requested: str, *, cuda_available: bool) -> str:
    if requested == "auto":
        return "nccl" if cuda_available else "gloo"
    if requested == "nccl" and not cuda_available:
        raise ConfigError("elastic.backend = 'nccl' needs CUDA; use 'gloo' or 'auto'")
    return requested


def wait_for_listener(host: str, port: int, *, timeout: float) -> bool:
    """Poll every 10 ms until something accepts connections on ``host:port``;
    whether it did within ``timeout`` seconds.

    torch's TCPStore client backs off for about 0.7 s after a refused connect,
    and rank 0 of a freshly forked group often binds its store a few ms after
    the other ranks start: 0.74 s against 0.05 s to connect, measured here.
    A failure is left to ``init_process_group``, which reports it.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def worker_device(env: WorkerEnv, cfg: ElasticConfig) -> torch.device:
    """This worker's device: GPU ``LOCAL_RANK`` (made current) under NCCL, else the CPU."""
    if choose_backend(cfg.backend, cuda_available=torch.cuda.is_available()) != "nccl":
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if env.local_rank >= visible:  # else CUDA's "invalid device ordinal", deep in the first op
        raise ConfigError(
            f"LOCAL_RANK {env.local_rank} needs GPU {env.local_rank} under NCCL, and "
            f"{visible} GPU(s) are visible; start at most {visible} workers per node "
            "(--nproc-per-node) or set elastic.backend = 'gloo'"
        )
    device = torch.device("cuda", env.local_rank)
    torch.cuda.set_device(device)
    return device


def init_distributed(env: WorkerEnv, cfg: ElasticConfig) -> DistContext:
    """Join the process group; each NCCL worker is bound to GPU ``LOCAL_RANK``."""
    backend = choose_backend(cfg.backend, cuda_available=torch.cuda.is_available())
    device = worker_device(env, cfg)
    if cfg.recovery == "inprocess":
        EtcdAccess.from_env().codec()  # a ConfigError naming what is missing, before any group
    if backend == "nccl":
        # Abort the communicator on a failed or timed-out collective: a dead peer
        # then ends the step with an error after pg_timeout_seconds instead of
        # blocking the GPU stream for good. 3 (torch's default, pinned) also tears
        # the process down; in-process recovery keeps it (2: clean up only).
        handling = "2" if cfg.recovery == "inprocess" else "3"
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", handling)
    timeout = timedelta(seconds=cfg.pg_timeout_seconds)
    if env.launched:
        # MASTER_ADDR/MASTER_PORT come from torchrun's rendezvous (env://).
        port = os.environ.get("MASTER_PORT", "")
        if env.rank != 0 and port.isdigit():
            wait_for_listener(
                os.environ["MASTER_ADDR"], int(port), timeout=min(cfg.pg_timeout_seconds, 60.0)
            )
        dist.init_process_group(
            backend, timeout=timeout, device_id=device if backend == "nccl" else None
        )
    else:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    log.info(
        "process_group_ready", backend=backend, device=str(device),
        world_size=env.world_size, timeout_s=cfg.pg_timeout_seconds,
    )  # fmt: skip
    return DistContext(env=env, backend=backend, device=device)


def broadcast_attempt_id(ctx: DistContext) -> str:
    """A fresh id for this (re)start, the same on every rank (rank 0 draws it).

    The 48 random bits travel as one integer in a tensor, not as a pickled
    object (``broadcast_object_list``): no rank unpickles a peer's bytes.
    """
    drawn = uuid.uuid4().int & _ATTEMPT_ID_MASK if ctx.is_main else 0
    holder = torch.tensor([drawn], dtype=torch.int64, device=ctx.device)
    dist.broadcast(holder, src=0)
    return f"{int(holder.item()):012x}"


def generation_attempt_id(lineage: str, generation: int) -> str:
    """The attempt id of in-process generation ``generation`` of ``lineage``: every
    member (and a joiner) knows both, so each derives the same id with no collective
    in the switch. A different id per generation, like a drawn one."""
    digest = hashlib.sha256(f"{lineage}/g{generation}".encode()).digest()
    return f"{int.from_bytes(digest[:6], 'big'):012x}"


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
