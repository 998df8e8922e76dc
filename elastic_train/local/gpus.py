"""Which GPUs each node of a local run gets, and when the run trains on the CPU.

Every node of ``elastic-train local`` is a torchrun agent on this one machine,
and each of its workers takes GPU ``LOCAL_RANK`` under NCCL. Left alone, node0
and node1 both put their first worker on GPU 0, and NCCL refuses the group at
its first collective ("Duplicate GPU detected": seen on an H200, 2026-11-28);
the agents restart the workers until the run times out. So the runner plans:

==============================  ===============================================
GPUs visible to the runner      what the nodes get
==============================  ===============================================
none, or ``backend = "gloo"``   nothing changes: the workers train on the CPU
at least one per worker that    node ``i`` sees only its own slice of them
may run at once (joiners too)   (``CUDA_VISIBLE_DEVICES``), so LOCAL_RANK 0 of
                                every node is a different GPU
fewer, ``backend = "auto"``     ``--elastic.backend=gloo`` for every worker (on
                                the CPU), and the log line ``local_gpus`` says why
fewer, ``backend = "nccl"``     refused before anything starts (ConfigError)
==============================  ===============================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elastic_train.errors import ConfigError

#: Where a GPU driver shows itself: NVIDIA's (also inside containers), Jetson's
#: (Tegra has no nvidiactl), AMD's ROCm and WSL 2's. None of them there:
#: ``torch.cuda.device_count()`` is 0.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvmap", "/dev/kfd", "/dev/dxg")


@dataclass(frozen=True)
class GpuPlan:
    """Per node index, the ``CUDA_VISIBLE_DEVICES`` it gets (none: unchanged), and the
    arguments every worker gets on top of its own."""

    devices: Mapping[int, str] = field(default_factory=dict)
    worker_args: tuple[str, ...] = ()
    reason: str = "no GPU visible"

    def env_for(self, index: int) -> dict[str, str]:
        """Node ``index``'s share of the environment."""
        return {"CUDA_VISIBLE_DEVICES": self.devices[index]} if self.devices else {}


def visible_gpus(environ: Mapping[str, str], count: int) -> list[str]:
    """The ``count`` GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` names them
    (indexes or UUIDs), so that a slice of them means the same to a child."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [name.strip() for name in listed.split(",") if name.strip()][:count]


def plan_gpus(
    gpus: Sequence[str], *, nodes: Sequence[int], nproc_per_node: int, backend: str | None
) -> GpuPlan:
    """The plan of the module docstring for the node indexes ``nodes`` (every node
    the run can start, joiners included) of ``nproc_per_node`` workers and the
    trainer's ``elastic.backend``; None: a script of its own, whose backend is
    unknown and whose arguments are left alone (it gets slices where they suffice)."""
    workers = len(nodes) * nproc_per_node
    if not gpus or backend == "gloo":
        reason = "no GPU visible" if not gpus else "elastic.backend = 'gloo'"
        return GpuPlan(reason=reason)
    if len(gpus) >= workers:
        k = nproc_per_node
        devices = {node: ",".join(gpus[i * k : (i + 1) * k]) for i, node in enumerate(nodes)}
        return GpuPlan(devices=devices, reason=f"{workers} worker(s), {len(gpus)} GPU(s)")
    shortfall = (
        f"{len(nodes)} node(s) x {nproc_per_node} process(es) = {workers} workers may run at "
        f"once, and {len(gpus)} GPU(s) are visible; NCCL needs a GPU per worker"
    )
    if backend is None:
        return GpuPlan(reason=f"{shortfall}; the script's own backend decides")
    if backend == "nccl":
        raise ConfigError(
            f"elastic.backend = 'nccl': {shortfall}. Accepted: at most {len(gpus)} "
            "workers (--nodes, --nproc-per-node, joins of the chaos schedule), or "
            "elastic.backend = 'auto' or 'gloo' (the CPU)"
        )
    return GpuPlan(worker_args=("--elastic.backend=gloo",), reason=f"{shortfall}: gloo on the CPU")


def local_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs a local run may hand out: none where this torch has no CUDA.

    ``device_count`` asks NVML, without initializing CUDA in this process
    (``is_available`` would); a GPU that CUDA then cannot use only gets a
    slice the workers ignore, since they fall back to gloo on the CPU.
    Without a GPU driver on the machine there is nothing to ask, and torch's
    import (2 s on a small box) is spared the runner.
    """
    if not any(Path(path).exists() for path in GPU_DRIVER_PATHS):
        return []
    import torch

    return visible_gpus(environ, torch.cuda.device_count())
