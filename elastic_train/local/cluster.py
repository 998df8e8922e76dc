"""``LocalCluster``: torchrun agents as "nodes" on one machine, and the faults
a chaos schedule inflicts on them. ``elastic_train.local.runner`` drives it.

Each node is one torchrun agent in its own session and process group, with
``ELASTIC_TRAIN_NODE=node<i>``. The rendezvous is the embedded etcd for the
etcd backends (``etcd-v2`` gets etcd's v2 API switched on) or a free loopback
port for ``c10d``, unless an endpoint is given.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from elastic_train.agent import zygote
from elastic_train.config.args import parse_cli
from elastic_train.errors import ClusterError, ConfigError
from elastic_train.etcd.server import EtcdServer, free_port
from elastic_train.local import proctree
from elastic_train.local.agent_forks import (
    AGENT_MODULE,
    AgentForks,
    ForkedAgent,
    start_agent_forks,
)
from elastic_train.local.chaos import ChaosEvent, node_count, node_indexes, validate_schedule
from elastic_train.local.embedded_etcd import start_embedded_etcd
from elastic_train.local.gpus import GpuPlan, local_gpus, plan_gpus
from elastic_train.local.rdzv_secret import planned_secret_file, with_secret_file, write_secret_file
from elastic_train.log import get_logger
from elastic_train.state.shm_names import remove_run_snapshots

log = get_logger(__name__)

MAIN_SCRIPT = Path(__file__).resolve().parent.parent / "main.py"
#: backends that rendezvous through the embedded etcd
ETCD_BACKENDS = frozenset({"etcd", "etcd-v3", "etcd-v2"})
#: set in every process of a run (inherited by workers) so the last cleanup
#: sweep finds even workers orphaned before the runner saw them
RUN_MARKER_ENV = "ELASTIC_TRAIN_LOCAL_RUN"
#: seconds between two scans for the processes of the nodes (see ``poll``)
SCAN_INTERVAL_S = 1.0
#: ``grace_s`` for the nodes still there once the trainer wrote its result (a frozen
#: worker's, a late joiner's): the final checkpoint is written, nothing of theirs is due
FINISHED_GRACE_S = 1.0
#: placeholders that ``script_args`` may contain, for scripts other than ours
PLACEHOLDERS = ("{run_dir}", "{audit_dir}", "{checkpoint_dir}")


@dataclass(frozen=True)
class ClusterSpec:
    """What to run. ``trainer_args`` only applies to elastic_train's own main.py."""

    nodes: int = 3
    nproc_per_node: int = 1
    #: ``--nnodes MIN:MAX``; MIN 1 lets any survivor go on alone
    min_nodes: int = 1
    #: default: every node that can exist (initial ones plus new joiners)
    max_nodes: int | None = None
    chaos: tuple[ChaosEvent, ...] = ()
    script: str = str(MAIN_SCRIPT)
    script_args: tuple[str, ...] = ()
    #: append ``--logging.audit_dir`` and ``--checkpoint.dir`` (our trainer's flags)
    trainer_args: bool = True
    rdzv_backend: str = "etcd"
    #: ``key=value,...`` for ``--rdzv-conf``; empty keeps the backend's defaults. Our
    #: backends get ``secret_file`` of a secret made per run unless this (or
    #: ``ELASTIC_TRAIN_RDZV_SECRET``) gives one, or ``insecure=true``
    rdzv_conf: str = ""
    #: an external rendezvous endpoint; None starts etcd (or picks a c10d port)
    rdzv_endpoint: str | None = None
    #: every kill and join costs one restart of the survivors
    max_restarts: int = 1000
    #: extra environment for the agents (and so the workers)
    env: tuple[tuple[str, str], ...] = ()
    #: the nodes' metrics endpoints (node_agent): node i on ``metrics_port + i``,
    #: 0 for free ports picked per node, None for none. One machine cannot give
    #: every agent node_agent's default port.
    metrics_port: int | None = 0
    timeout_s: float = 900.0
    #: on abort: seconds between SIGTERM to the agents and SIGKILL to everything
    grace_s: float = 5.0
    #: once the trainer wrote its result: seconds the nodes get to exit by themselves
    #: (a node whose worker a chaos ``stop`` froze never does; tests shorten this)
    finish_grace_s: float = 15.0
    #: fork the agents from one launcher that imported torch once (:mod:`.agent_forks`)
    #: instead of starting each as an interpreter of its own
    fork_agents: bool = True

    def __post_init__(self) -> None:
        for name in ("nodes", "nproc_per_node", "min_nodes", "max_restarts"):
            if getattr(self, name) < (0 if name == "max_restarts" else 1):
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.min_nodes > self.nodes:
            raise ConfigError(f"min_nodes ({self.min_nodes}) exceeds nodes ({self.nodes})")
        if self.max_nodes is not None and self.max_nodes < self.node_count:
            raise ConfigError(
                f"max_nodes ({self.max_nodes}) is below the {self.node_count} nodes "
                "that the nodes and the chaos joins can start"
            )
        if self.timeout_s <= 0 or self.grace_s < 0 or self.finish_grace_s < 0:
            raise ConfigError("timeout_s must be > 0, grace_s and finish_grace_s >= 0")
        if self.rdzv_endpoint is None and self.rdzv_backend not in ETCD_BACKENDS | {"c10d"}:
            raise ConfigError(
                f"rdzv_backend {self.rdzv_backend!r} needs rdzv_endpoint; the runner hosts "
                f"only {', '.join(sorted(ETCD_BACKENDS | {'c10d'}))}"
            )
        validate_schedule(self.chaos, nodes=self.nodes)

    @property
    def node_count(self) -> int:
        return node_count(self.chaos, nodes=self.nodes)

    @property
    def nnodes(self) -> str:
        return f"{self.min_nodes}:{self.max_nodes or self.node_count}"


@dataclass
class Node:
    """One node's agent; ``fate`` says what the runner did to its latest incarnation."""

    index: int
    #: a started agent, or one forked from the run's launcher (:mod:`.agent_forks`)
    proc: subprocess.Popen[bytes] | ForkedAgent
    fate: str = "running"
    stopped: list[psutil.Process] = field(default_factory=list)
    #: wall time, comparable with the audit records' times
    started_at: float = field(default_factory=time.time)

    @property
    def name(self) -> str:
        return f"node{self.index}"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def state(self) -> str:
        if self.alive:
            return self.fate
        if self.fate in ("killed", "terminated"):
            return self.fate
        return f"exited({self.proc.returncode})"


class LocalCluster:
    """Starts and supervises the nodes; ``close()`` leaves no process behind."""

    def __init__(self, spec: ClusterSpec, *, run_dir: str | Path) -> None:
        self.spec = spec
        self.run_dir = Path(run_dir)
        self.run_id = f"local-{uuid.uuid4().hex[:12]}"
        self.nodes: dict[int, Node] = {}
        self.etcd: EtcdServer | None = None
        self.etcd_login: dict[str, str] = {}  # the embedded etcd's user, for the agents
        self.endpoint = spec.rdzv_endpoint or ""
        #: the job secret this run makes, or None: the spec gives one, or the backend signs nothing
        self.secret_file, self._secret_source = planned_secret_file(
            spec.rdzv_backend, spec.rdzv_conf, {**os.environ, **dict(spec.env)}, self.run_dir
        )
        self._seen: dict[tuple[int, float], psutil.Process] = {}
        self._free_ports: dict[int, int] = {}
        self._last_scan = float("-inf")
        #: every agent ever started, for the last wait (nodes holds the latest only)
        self.incarnations: list[Node] = []
        self._forks: AgentForks | None = None
        #: the trainer wrote its result (the supervisor sees it): see FINISHED_GRACE_S
        self.job_finished = False

    @property
    def audit_dir(self) -> Path:
        return self.run_dir / "audit"

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def launcher_pid(self) -> int | None:
        """The pid of the process that forks the agents (:mod:`.agent_forks`), if any."""
        return self._forks.pid if self._forks is not None else None

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        self._check_trainer_args()
        # A GPU left unused on purpose is worth a warning: the user may have expected it.
        say = log.warning if self.gpus.worker_args else log.info
        say("local_gpus", plan=self.gpus.reason, devices=dict(self.gpus.devices),
            worker_args=list(self.gpus.worker_args))  # fmt: skip
        self._check_metrics_ports()
        if self.audit_dir.is_dir() and any(self.audit_dir.iterdir()):
            # Old records and an old result.json would be audited as this run's.
            raise ConfigError(f"run_dir {self.run_dir} already holds a run; use a new one")
        for sub in ("audit", "checkpoints", "logs"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        if self.secret_file is not None:
            write_secret_file(self.secret_file)
        log.info("local_rdzv_secret", source=self._secret_source, file=str(self.secret_file or ""))
        if self.spec.fork_agents:  # it imports while etcd starts
            self._forks = start_agent_forks(self.shared_env(), self.run_dir / "logs")
        if not self.endpoint:
            self.endpoint = self._start_rendezvous_server()
        for index in range(self.spec.nodes):
            self.start_node(index)

    def _check_trainer_args(self) -> None:
        """Refuse a bad override before starting anything.

        Workers would exit with a config error and their agents restart them,
        up to ``max_restarts`` times, so the runner checks first.
        """
        if Path(self.spec.script).resolve() == MAIN_SCRIPT.resolve():
            parse_cli(self.worker_args())

    def _check_metrics_ports(self) -> None:
        """A taken port would crash that node's agent at its first rendezvous."""
        for index in range(self.spec.node_count):
            port = self.metrics_port(index)
            if port and not port_is_free(port):
                raise ConfigError(
                    f"metrics_port: port {port} of node{index} is in use; choose another "
                    "base port, 0 for free ports, or off"
                )

    def _start_rendezvous_server(self) -> str:
        if self.spec.rdzv_backend == "c10d":
            # The first agent to bind the port hosts the TCPStore.
            return f"127.0.0.1:{free_port()}"
        self.etcd, self.etcd_login = start_embedded_etcd(
            backend=self.spec.rdzv_backend, rdzv_conf=self.spec.rdzv_conf,
            data_dir=self.run_dir / "etcd" / "data",
        )  # fmt: skip
        log.info("local_etcd_started", endpoint=self.etcd.endpoint, pid=self.etcd.process.pid,  # type: ignore[union-attr]
                 authentication=bool(self.etcd_login))  # fmt: skip
        return self.etcd.endpoint

    def worker_args(self) -> list[str]:
        """The worker script's arguments: ``script_args`` filled in, plus our trainer's
        dirs and, where the GPUs are too few, its backend (:mod:`.gpus`)."""
        return [*self._own_args(), *self.gpus.worker_args]

    def _own_args(self) -> list[str]:
        args = [self._fill(arg) for arg in self.spec.script_args]
        if self.spec.trainer_args:
            args += [
                f"--logging.audit_dir={self.audit_dir}",
                f"--checkpoint.dir={self.checkpoint_dir}",
            ]
        return args

    @functools.cached_property
    def gpus(self) -> GpuPlan:
        """Each node's GPUs, or the CPU for all (:mod:`.gpus`); decided once per run."""
        backend = None
        main = Path(self.spec.script).resolve() == MAIN_SCRIPT.resolve()
        if main or self.spec.trainer_args:  # a script of api.fit's takes main.py's arguments
            try:
                backend = parse_cli(self._own_args()).config.elastic.backend
            except ConfigError:
                if main:
                    raise
                # ...or flags of its own: left alone
        environ = {**os.environ, **dict(self.spec.env)}
        return plan_gpus(
            local_gpus(environ), nodes=node_indexes(self.spec.chaos, nodes=self.spec.nodes),
            nproc_per_node=self.spec.nproc_per_node, backend=backend,
        )  # fmt: skip

    def command(self) -> list[str]:
        spec = self.spec
        rdzv_conf = spec.rdzv_conf
        if self.secret_file is not None:
            rdzv_conf = with_secret_file(rdzv_conf, self.secret_file)
        conf = [f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else []
        return [
            *(sys.executable, "-m", "torch.distributed.run"),
            f"--nnodes={spec.nnodes}",
            f"--nproc-per-node={spec.nproc_per_node}",
            f"--rdzv-backend={spec.rdzv_backend}",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--max-restarts={spec.max_restarts}",
            f"--log-dir={self.run_dir / 'torchelastic'}",  # not a new /tmp dir per agent
            *conf,
            spec.script,
            *self.worker_args(),
        ]

    def _fill(self, arg: str) -> str:
        values = (self.run_dir, self.audit_dir, self.checkpoint_dir)
        for placeholder, value in zip(PLACEHOLDERS, values, strict=True):
            arg = arg.replace(placeholder, str(value))
        return arg

    def shared_env(self) -> dict[str, str]:
        """The environment every node's agent starts with (the launcher's too)."""
        env = {**os.environ, **dict(self.spec.env), "PYTHONUNBUFFERED": "1"}
        env[RUN_MARKER_ENV] = self.run_id
        # All "nodes" share this machine's cores; torchrun sets OMP_NUM_THREADS only
        # for nproc-per-node > 1, and oversubscribed intra-op threads slow every step.
        workers = max(1, self.spec.nodes * self.spec.nproc_per_node)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
        return env

    def node_env(self, index: int) -> dict[str, str]:
        env = self.shared_env() | {"ELASTIC_TRAIN_NODE": f"node{index}"} | self.etcd_login
        env |= self.gpus.env_for(index)
        env["ELASTIC_TRAIN_METRICS_PORT"] = str(self.metrics_port(index) or "off")
        env.setdefault("ELASTIC_TRAIN_METRICS_HOST", "127.0.0.1")
        env.setdefault("ELASTIC_TRAIN_METRICS_DIR", str(self.run_dir / "metrics"))  # not /tmp
        return env

    def start_node(self, index: int) -> Node:
        if index in self.nodes and self.nodes[index].alive:
            raise ClusterError(f"node{index} is already running")
        env, command = self.node_env(index), self.command()
        log_path = self.run_dir / "logs" / f"node{index}.log"
        proc: subprocess.Popen[bytes] | ForkedAgent | None = None
        if self._forks is not None and command[1:3] == ["-m", AGENT_MODULE]:
            proc = self._forks.fork(command[3:], env=env, log_path=log_path)
        if proc is None:
            with open(log_path, "ab") as out:
                proc = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, start_new_session=True,
                )  # fmt: skip
        node = self.nodes[index] = Node(index=index, proc=proc)
        self.incarnations.append(node)
        self._remember([psutil.Process(proc.pid)])
        forked = isinstance(proc, ForkedAgent)
        log.info("local_node_started", node=node.name, pid=proc.pid, forked=forked,
                 metrics_port=self.metrics_port(index))  # fmt: skip
        return node

    def metrics_port(self, index: int) -> int | None:
        """The node's metrics port, the same for every incarnation of the node."""
        if self.spec.metrics_port is None:
            return None
        if self.spec.metrics_port:
            return self.spec.metrics_port + index
        return self._free_ports.setdefault(index, free_port())

    def alive_nodes(self) -> list[Node]:
        return [node for node in self.nodes.values() if node.alive]

    def poll(self) -> None:
        """Reap exited agents; now and then remember every process seen, for the final sweep.

        Listing descendants scans /proc, so it is throttled: callers (the
        benchmarks) may poll many times a second on a 2-core machine.
        """
        alive = self.alive_nodes()
        if time.monotonic() - self._last_scan < SCAN_INTERVAL_S:
            return
        self._last_scan = time.monotonic()
        for node in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                self._remember(proctree.descendants(psutil.Process(node.proc.pid)))

    def _remember(self, procs: list[psutil.Process]) -> None:
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
                self._seen.setdefault((proc.pid, proc.create_time()), proc)

    def deliver(self, event: ChaosEvent) -> str | None:
        """Carry out one event; the outcome, or None to retry on the next tick.

        Retried: a stop while the node has no worker, a join while the
        node's terminated agent is still shutting down.
        """
        if event.node is None:
            raise ClusterError(f"chaos event {event} must be resolved to a node index first")
        node = self.nodes.get(event.node)
        running = node is not None and node.alive
        if event.kind == "join":
            if running and node.fate == "terminated":  # type: ignore[union-attr]
                return None  # rejoin once the old agent finished shutting down
            if running:
                return f"skipped: node{event.node} is already running"
            self.start_node(event.node)
            return "delivered"
        if node is None or not running:
            return f"skipped: node{event.node} is not running"
        agent = psutil.Process(node.proc.pid)
        if event.kind == "kill":
            procs = proctree.kill_tree(agent)
            self._remember(procs)
            node.proc.wait()
            self._make_sure_gone(event.node, procs, own=frozenset({agent.pid}))
            node.fate = "killed"
        elif event.kind == "term":
            node.proc.send_signal(signal.SIGTERM)
            node.fate = "terminated"
        else:
            return self._stop_one_worker(node, agent)
        return "delivered"

    def _make_sure_gone(
        self, node: int, procs: list[psutil.Process], *, own: frozenset[int]
    ) -> None:
        """Wait for a killed node's processes; SIGKILL any left once more, and say so.

        A killed worker that lived on would keep its sockets open, and its
        peers' collectives would wait for their timeout instead of failing.
        """
        survivors = proctree.kill_survivors(procs, own=own)
        if survivors:
            log.warning("chaos_kill_survivors", node=f"node{node}", processes=survivors)

    def _stop_one_worker(self, node: Node, agent: psutil.Process) -> str | None:
        try:
            workers = sorted(zygote.trainer_processes(agent), key=lambda p: p.pid)
        except psutil.NoSuchProcess:
            return None
        if not workers:
            return None
        workers[0].suspend()
        node.stopped.append(workers[0])
        node.fate = "worker-stopped"
        return "delivered"

    def close(self) -> None:
        """Stop everything this cluster started, however we got here."""
        with proctree.sigint_deferred():
            try:
                self._stop_nodes()
            finally:
                if self._forks is not None:  # after the nodes: it reports how they exited
                    self._forks.close()
            if self.etcd is not None:
                self.etcd.stop()
                shutil.rmtree(self.run_dir / "etcd", ignore_errors=True)
            remove_run_snapshots(self.run_id)  # killed nodes' /dev/shm snapshots
            if self.secret_file is not None:  # no use once every agent is gone
                self.secret_file.unlink(missing_ok=True)

    def _stop_nodes(self) -> None:
        self._last_scan = float("-inf")  # a fresh scan: the last one may be a second old
        self.poll()
        alive = self.alive_nodes()
        if alive:
            log.info("local_nodes_stopping", nodes=[node.name for node in alive])
            for node in alive:
                with contextlib.suppress(ProcessLookupError):
                    node.proc.send_signal(signal.SIGTERM)
            # A SIGSTOPped worker only acts on SIGTERM once continued.
            stopped = [proc for node in self.nodes.values() for proc in node.stopped]
            proctree.signal_all(stopped, signal.SIGCONT)
            grace = self.spec.grace_s
            if self.job_finished:
                grace = min(grace, FINISHED_GRACE_S)
            proctree.wait_gone(self._seen_list(), timeout=grace, own=self._own())
        leftovers = proctree.alive(self._seen_list())
        leftovers += [p for p in proctree.marked_processes(RUN_MARKER_ENV, self.run_id)
                      if p.pid != self.launcher_pid]  # fmt: skip
        for proc in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                self._remember(proctree.kill_tree(proc))
        proctree.wait_gone(self._seen_list(), own=self._own())
        for node in self.incarnations:
            node.proc.wait()

    def _seen_list(self) -> list[psutil.Process]:
        return list(self._seen.values())

    def _own(self) -> frozenset[int]:
        return frozenset(node.proc.pid for node in self.incarnations)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
