"""Launch modes besides torchrun: ``elastic-train spawn`` and the Slurm mapping.

``elastic-train spawn --nproc N [trainer args]`` starts N workers on this
machine with ``torch.multiprocessing.spawn``: each child gets the environment
torchrun would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...,
``MASTER_ADDR``/``MASTER_PORT`` of a fresh loopback port) and runs the same
entry as ``main.py``. There is no agent, so no elasticity: a failed worker ends
the group; ``--max-restarts`` starts a new group that resumes from the latest
checkpoint.

Slurm: :func:`slurm_torchrun_args` maps the ``SLURM_*`` variables of one
``srun`` task per node to torchrun's arguments (one agent per node, first node
of the allocation as the etcd host unless an endpoint is given), and
:func:`slurm_worker_env` maps an ``srun`` task per GPU (no torchrun) to the
worker environment.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastic_train.errors import EXIT_CONFIG_ERROR, ConfigError
from elastic_train.etcd.server import free_port
from elastic_train.log import get_logger

log = get_logger(__name__)

# -- torch.multiprocessing.spawn -------------------------------------------------


def worker_env(*, rank: int, world_size: int, master_port: int) -> dict[str, str]:
    """The variables torchrun would set for a single-node worker."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
    }


def _spawned_worker(
    rank: int, world_size: int, master_port: int, restart: int, argv: list[str]
) -> None:
    os.environ.update(worker_env(rank=rank, world_size=world_size, master_port=master_port))
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(restart)
    from elastic_train.main import main

    code = main(argv)
    if code:
        sys.exit(code)


def spawn(nproc: int, argv: Sequence[str], *, max_restarts: int = 0) -> int:
    """Run the trainer in ``nproc`` local processes; returns an exit code."""
    import torch.multiprocessing as mp

    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    code = 1
    for restart in range(max_restarts + 1):
        port = free_port()
        log.info("spawn_group", nproc=nproc, master_port=port, restart=restart)
        try:
            mp.spawn(_spawned_worker, args=(nproc, port, restart, list(argv)), nprocs=nproc)
            return 0
        except mp.ProcessExitedException as exc:
            code = exc.exit_code if exc.exit_code is not None and exc.exit_code > 0 else 1
            log.error("spawn_worker_failed", rank=exc.error_index, exit_code=code)
        except mp.ProcessRaisedException as exc:
            code = 1
            log.error("spawn_worker_failed", rank=exc.error_index, error=str(exc)[-500:])
        if code == EXIT_CONFIG_ERROR:  # a restart cannot fix the config
            break
    return code


def add_spawn_subcommand(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "spawn",
        help="run N workers on this machine with torch.multiprocessing.spawn (no agent)",
        description="Start N trainer processes on one machine without torchrun. "
        "Unknown arguments (--config PATH, --SECTION.KEY=VALUE) go to the trainer.",
    )
    p.add_argument("--nproc", type=int, required=True, help="number of worker processes")
    p.add_argument(
        "--max-restarts", type=int, default=0, help="new groups after a failure (default 0)"
    )
    p.set_defaults(handler=_run_spawn)


def _run_spawn(args: argparse.Namespace, trainer_args: list[str]) -> int:
    return spawn(args.nproc, trainer_args, max_restarts=args.max_restarts)


# -- Slurm ------------------------------------------------------------------------

_HOST_GROUP = re.compile(r"([^,\[]+)(?:\[([^\]]+)\])?(?:,|$)")


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list: ``"gpu[01-03,07],login1"`` -> 4 + 1 names."""
    hosts: list[str] = []
    pos = 0
    while pos < len(hostlist):
        match = _HOST_GROUP.match(hostlist, pos)
        if not match or match.end() == pos:
            raise ConfigError(f"SLURM_JOB_NODELIST={hostlist!r} is not a Slurm host list")
        prefix, ranges = match.group(1), match.group(2)
        if ranges is None:
            hosts.append(prefix)
        for part in (ranges or "").split(",") if ranges else []:
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ConfigError(f"SLURM_JOB_NODELIST={hostlist!r}: bad range {part!r}")
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{len(low)}d}")
        pos = match.end()
    return hosts


def _slurm_int(env: Mapping[str, str], *names: str) -> int:
    for name in names:
        raw = env.get(name)
        if raw is not None:
            try:
                return int(raw.split("(")[0])  # SLURM_TASKS_PER_NODE looks like "2(x3)"
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not an integer") from None
    raise ConfigError(f"not inside a Slurm job step: none of {', '.join(names)} is set")


@dataclass(frozen=True)
class SlurmLaunch:
    """One torchrun agent per node, as ``srun --ntasks-per-node=1 torchrun ...`` needs."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    rdzv_endpoint: str
    rdzv_id: str

    def torchrun_args(self, *, min_nodes: int | None = None, backend: str = "etcd") -> list[str]:
        nnodes = f"{min_nodes}:{self.nnodes}" if min_nodes else str(self.nnodes)
        return [
            f"--nnodes={nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--rdzv-backend={backend}",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.rdzv_id}",
        ]


def slurm_torchrun_args(
    env: Mapping[str, str], *, etcd_endpoint: str | None = None, etcd_port: int = 2379
) -> SlurmLaunch:
    """Map one ``srun`` task per node to torchrun's arguments.

    ``node_rank`` is informational: with a rendezvous backend torchrun assigns
    ranks itself, which is what lets a node leave and rejoin.
    """
    hosts = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    if not hosts:
        raise ConfigError("SLURM_JOB_NODELIST is not set: not inside a Slurm allocation")
    nnodes = _slurm_int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    if nnodes != len(hosts):
        raise ConfigError(f"SLURM_JOB_NUM_NODES={nnodes} but the node list has {len(hosts)}")
    gpus = env.get("SLURM_GPUS_ON_NODE")
    return SlurmLaunch(
        nnodes=nnodes,
        node_rank=_slurm_int(env, "SLURM_NODEID"),
        nproc_per_node=int(gpus) if gpus and gpus.isdigit() and int(gpus) > 0 else 1,
        rdzv_endpoint=etcd_endpoint or f"{hosts[0]}:{etcd_port}",
        rdzv_id=f"slurm-{_slurm_int(env, 'SLURM_JOB_ID')}",
    )


def slurm_worker_env(env: Mapping[str, str], *, master_port: int = 29500) -> dict[str, str]:
    """Map one ``srun`` task per GPU (no torchrun) to the worker environment."""
    hosts = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    if not hosts:
        raise ConfigError("SLURM_JOB_NODELIST is not set: not inside a Slurm allocation")
    return {
        "RANK": str(_slurm_int(env, "SLURM_PROCID")),
        "WORLD_SIZE": str(_slurm_int(env, "SLURM_NTASKS")),
        "LOCAL_RANK": str(_slurm_int(env, "SLURM_LOCALID")),
        "LOCAL_WORLD_SIZE": str(_slurm_int(env, "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")),
        "GROUP_RANK": str(_slurm_int(env, "SLURM_NODEID")),
        "MASTER_ADDR": hosts[0],
        "MASTER_PORT": str(master_port),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m elastic_train.launch slurm-torchrun-args|slurm-worker-env`` for job scripts."""
    parser = argparse.ArgumentParser(prog="python -m elastic_train.launch")
    sub = parser.add_subparsers(dest="what", required=True)
    args_p = sub.add_parser("slurm-torchrun-args", help="torchrun arguments for this srun task")
    args_p.add_argument("--etcd-endpoint", help="host:port; default: first node, --etcd-port")
    args_p.add_argument("--etcd-port", type=int, default=2379)
    args_p.add_argument("--min-nodes", type=int, default=None, help="MIN of --nnodes MIN:MAX")
    args_p.add_argument("--rdzv-backend", default="etcd")
    env_p = sub.add_parser("slurm-worker-env", help="export lines for one srun task per GPU")
    env_p.add_argument("--master-port", type=int, default=29500)
    args = parser.parse_args(argv)
    try:
        if args.what == "slurm-torchrun-args":
            launch = slurm_torchrun_args(
                os.environ, etcd_endpoint=args.etcd_endpoint, etcd_port=args.etcd_port
            )
            print(
                " ".join(launch.torchrun_args(min_nodes=args.min_nodes, backend=args.rdzv_backend))
            )
        else:
            for key, value in slurm_worker_env(os.environ, master_port=args.master_port).items():
                print(f"export {key}={value}")
    except ConfigError as exc:
        print(f"elastic_train.launch: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
