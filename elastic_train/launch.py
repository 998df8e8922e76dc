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

``elastic-train rdzv reset --endpoint HOST:PORT --run-id ID`` deletes one run's
rendezvous keys (:func:`reset_run`), so that a new job under a fixed run id
(compose, Kubeflow) does not meet the old job's closed rendezvous.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from elastic_train.errors import EXIT_CONFIG_ERROR, ConfigError
from elastic_train.etcd.client import EtcdClient, EtcdClientConfig
from elastic_train.etcd.server import free_port
from elastic_train.log import exit_now, get_logger

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

    # As main.py's own entry: the interpreter's teardown after torch took about 2 s
    # of each worker's exit, and the group's end waits for the last one.
    exit_now(main(argv, release=False))


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


# -- elastic-train rdzv reset ------------------------------------------------------

#: the rendezvous backend's default ``key_prefix`` (rdzv-conf)
DEFAULT_KEY_PREFIX = "/elastic_train"


def run_key_prefix(key_prefix: str, run_id: str) -> bytes:
    """The etcd prefix under which the backend keeps one run's keys: state,
    heartbeats and store (``elastic_train.rendezvous.backend.create_backend``).

    The trailing ``/`` keeps run ``job-1`` from matching run ``job-10``.
    """
    prefix = key_prefix.rstrip("/")
    if not prefix.startswith("/"):
        raise ConfigError(f"--key-prefix {key_prefix!r} must be an absolute key prefix, e.g. /a")
    if not run_id.strip():
        raise ConfigError("--run-id is empty; give the job's --rdzv-id")
    return f"{prefix}/{run_id}/".encode()


def reset_run(
    client: EtcdClient, *, key_prefix: str, run_id: str, out: TextIO, dry_run: bool = False
) -> list[str]:
    """Delete every key of run ``run_id``, printing each first; returns the keys deleted.

    Only for a run none of whose agents is alive: an agent of a live run
    would find its rendezvous gone and fail its next round.
    """
    prefix = run_key_prefix(key_prefix, run_id)
    found, _ = client.get_prefix(prefix)
    print(f"{len(found)} key(s) under {prefix.decode()}", file=out)
    deleted = []
    for kv in found:
        name = kv.key.decode(errors="replace")
        print(f"{'would delete' if dry_run else 'delete'} {name}", file=out)
        if not dry_run and client.delete(kv.key):
            deleted.append(name)
    log.info("rdzv_reset", run_id=run_id, prefix=prefix.decode(), deleted=len(deleted))
    return deleted


def reset_client_config(args: argparse.Namespace, env: Mapping[str, str]) -> EtcdClientConfig:
    """The etcd client of ``rdzv reset``: TLS files from flags, the user from the environment."""
    tls = any((args.cacert, args.cert, args.key))
    try:
        return EtcdClientConfig(
            endpoints=tuple(e.strip() for e in args.endpoint.split(",") if e.strip()),
            protocol="https" if tls else args.protocol,
            cacert=args.cacert,
            cert=args.cert,
            key=args.key,
            username=env.get("ETCD_USERNAME") or None,
            password=env.get("ETCD_PASSWORD") or None,
        )
    except ValueError as exc:
        raise ConfigError(
            f"rdzv reset: {exc} (ETCD_USERNAME/ETCD_PASSWORD, --cacert/--cert/--key)"
        ) from exc


def add_rdzv_subcommand(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    rdzv = subparsers.add_parser("rdzv", help="maintain the etcd rendezvous of a job")
    actions = rdzv.add_subparsers(dest="rdzv_command", required=True)
    p = actions.add_parser(
        "reset",
        help="delete one run's rendezvous keys (state, heartbeats, store)",
        description="Delete the etcd keys of the rendezvous of run ID, after printing "
        "each one, so that a new job with the same --rdzv-id starts a fresh rendezvous. "
        "Run it only when no agent of that run is alive. The etcd user comes from "
        "ETCD_USERNAME/ETCD_PASSWORD.",
    )
    p.add_argument("--endpoint", required=True, help="host:port[,host:port...] of etcd")
    p.add_argument("--run-id", required=True, help="the job's --rdzv-id")
    p.add_argument(
        "--key-prefix",
        default=DEFAULT_KEY_PREFIX,
        help=f"the job's rdzv-conf key_prefix (default {DEFAULT_KEY_PREFIX})",
    )
    p.add_argument("--protocol", choices=("http", "https"), default="http")
    p.add_argument("--cacert", help="CA bundle for TLS (implies https)")
    p.add_argument("--cert", help="client certificate for TLS")
    p.add_argument("--key", help="client certificate key for TLS")
    p.add_argument("--dry-run", action="store_true", help="print the keys, delete nothing")
    p.set_defaults(handler=_run_rdzv_reset)


def _run_rdzv_reset(args: argparse.Namespace, extra: list[str]) -> int:
    client = EtcdClient(reset_client_config(args, os.environ))
    try:
        reset_run(
            client, key_prefix=args.key_prefix, run_id=args.run_id, out=sys.stdout,
            dry_run=args.dry_run,
        )  # fmt: skip
    finally:
        client.close()
    return 0


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
