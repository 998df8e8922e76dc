"""The node agent: what elastic_train adds to each torchrun agent process.

The torchrun plugin (:mod:`elastic_train.torchrun_plugin`) builds one
:class:`NodeAgent` per agent process from the agent's rdzv-conf keys, starts
it, and wraps the rendezvous handler with :meth:`NodeAgent.attach`. The agent
then owns:

- the node's metrics endpoint (:mod:`elastic_train.agent.metrics_endpoint`);
- the timing of every rendezvous round, and of every restart after the first;
- the node's zygote (:mod:`elastic_train.agent.zygote`), which forks warm
  workers, replaced if it dies;
- the node's checkpoint persister (:mod:`elastic_train.agent.persister`),
  which writes ``checkpoint.writer = "agent"`` checkpoints from the node's
  snapshot, off the training processes.

Settings, each an ``--rdzv-conf`` key, else an environment variable, else the
default (the key wins, so a command line says what it does):

=================  ===============================  =================================
rdzv-conf key      environment variable             default
=================  ===============================  =================================
``metrics_port``   ``ELASTIC_TRAIN_METRICS_PORT``   ``9402``; in use: the next free one
                                                    of 32 upward, else no metrics;
                                                    ``0`` picks a free port;
                                                    ``off`` serves nothing
``metrics_host``   ``ELASTIC_TRAIN_METRICS_HOST``   ``0.0.0.0``: every interface, so that
                                                    Prometheus can scrape the pod or
                                                    host from outside; set an address
                                                    (``127.0.0.1``, the cluster one)
                                                    to serve only there
``metrics_dir``    ``ELASTIC_TRAIN_METRICS_DIR``    the system temporary directory
``warm_start``     ``ELASTIC_TRAIN_WARM_START``     ``auto``: on (Linux) when the workers
                                                    run ``elastic_train/main.py``;
                                                    ``1`` for any Python entry that
                                                    calls ``hand_over``; ``0`` off
``preload``        ``ELASTIC_TRAIN_PRELOAD``        none; modules the zygote imports
                                                    for the workers, joined by ``+``
                                                    (``transformers+torchvision``)
=================  ===============================  =================================

``metrics_dir`` is the *parent* of the per-run directory; only the per-run
directory, which the endpoint made, is ever deleted. A ``metrics_port`` in use
(another agent on this host) moves the endpoint to the next free port, logged
as ``metrics_endpoint_port_taken`` (an error when ``metrics_port`` was given,
a warning for the default); the agent never dies of it.

Every worker the agent spawns gets ``ELASTIC_TRAIN_AGENT_PID``; the worker's
``hand_over()`` ties its life to the agent's (``warm_start.die_with_agent``).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)

from elastic_train import metrics
from elastic_train.agent import verdict, warm_start
from elastic_train.agent.metrics_endpoint import MetricsEndpoint, MetricsEndpointConfig
from elastic_train.agent.persister import Persister
from elastic_train.agent.settings import agent_setting
from elastic_train.agent.worker_entry import WorkerEntry
from elastic_train.agent.zygote import EXIT_UNSAFE_PRELOAD, ZygoteProcess, zygote_entry
from elastic_train.errors import EXIT_CONFIG_ERROR, ConfigError, MetricsPortsTakenError
from elastic_train.log import bind_context, get_logger
from elastic_train.state.persist import SOCKET_ENV as PERSIST_SOCKET_ENV

__all__ = ["RDZV_CONF_KEYS", "AgentSettings", "NodeAgent", "NodeAgentHandler"]

log = get_logger(__name__)

#: The ``--rdzv-conf`` keys the node agent reads; the plugin tells the backend to accept them.
RDZV_CONF_KEYS = frozenset({"metrics_port", "metrics_host", "metrics_dir", "warm_start", "preload"})


@dataclass(frozen=True)
class AgentSettings:
    """The node agent's settings; ``warm_start=None`` is ``auto``."""

    metrics: MetricsEndpointConfig = field(default_factory=MetricsEndpointConfig)
    warm_start: bool | None = None
    #: modules the zygote imports after the trainer (:func:`warm_start.parse_preload`)
    preload: tuple[str, ...] = ()

    @classmethod
    def from_params(
        cls, params: RendezvousParameters, environ: Mapping[str, str] = os.environ
    ) -> AgentSettings:
        """Parse the agent's rdzv-conf keys; :class:`ConfigError` names a bad one."""
        try:
            enabled = warm_start.parse_warm_start(agent_setting(params, "warm_start", environ))
            preload = warm_start.parse_preload(agent_setting(params, "preload", environ))
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        metrics = MetricsEndpointConfig.from_params(params, environ)
        return cls(metrics=metrics, warm_start=enabled, preload=preload)

    def zygote_entry(self, argv: Sequence[str]) -> WorkerEntry | None:
        """The entry a zygote should preload for, or None for no zygote (with the reason logged)."""
        entry, reason = zygote_entry(self.warm_start, argv)
        if entry is None:
            unsupported = self.warm_start and sys.platform != "linux"
            (log.warning if unsupported else log.info)("warm_start_disabled", reason=reason)
        return entry


class NodeAgent:
    """The node's endpoint and zygote, and the timing of its rendezvous rounds."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        run_id: str,
        argv: Sequence[str],
        zygote: ZygoteProcess | None = None,
    ) -> None:
        """``zygote``: one forked early (:func:`~elastic_train.agent.zygote.fork_early`),
        released by :meth:`start`; else :meth:`start` spawns one."""
        self._settings = settings
        self._run_id = run_id
        self._entry = settings.zygote_entry(argv)
        self.endpoint: MetricsEndpoint | None = None
        self.zygote = zygote
        self.persister: Persister | None = None
        self._rounds = 0
        self._config_error_file: Path | None = None

    def start(self, *, min_nodes: int, max_nodes: int) -> None:
        """Serve metrics, then start the zygote (its imports must see the metrics directory)."""
        # Before the agent's own closers, so it runs after them: the interpreter's final
        # collections skip every object alive then (torch's), 0.6 s of each exit (py-spy).
        atexit.register(gc.freeze)
        node = metrics.node_name()
        bind_context(run_id=self._run_id, node=node)
        # torchrun copies this into every worker: they die with this process (docs/warm-start.md).
        os.environ[warm_start.AGENT_PID_ENV] = str(os.getpid())
        self._listen_for_config_errors()
        self.endpoint = self._start_endpoint()
        self._start_persister()
        self._start_zygote()
        metrics.MIN_NODES.labels(node).set(min_nodes)
        metrics.MAX_NODES.labels(node).set(max_nodes)
        # Every series from the start, so a first restart shows as 0 -> 1, not a new series.
        for series in (
            metrics.RESTARTS,
            metrics.RDZV_ROUNDS,
            metrics.WORLD_SIZE,
            metrics.RDZV_SECONDS,
        ):
            series.labels(node)
        metrics.NODES.labels(node).set(
            0
        )  # not in a round yet: a first round that never ends alerts

    def _listen_for_config_errors(self) -> None:
        """A directory of this agent's for a worker's configuration error (verdict.py)."""
        self._config_error_file = verdict.config_error_file()
        os.environ[verdict.CONFIG_ERROR_FILE_ENV] = str(self._config_error_file)

    def group_formed_file(self, round_: int) -> Path:
        """The file this agent's workers of rendezvous round ``round_`` create once their
        process group formed (:mod:`.verdict`); after :meth:`start`."""
        assert self._config_error_file is not None
        return verdict.group_formed_file(self._config_error_file.parent, round_)

    def _exit_on_config_error(self) -> None:
        """Before a restart: a worker's configuration error ends this agent instead."""
        if self._config_error_file is None:
            return
        message = verdict.read_config_error(self._config_error_file)
        if message is None:
            return
        log.error(
            "worker_config_error", error=message, exit_code=EXIT_CONFIG_ERROR,
            action="the agent exits: a restart cannot fix the configuration",
        )  # fmt: skip
        raise SystemExit(EXIT_CONFIG_ERROR)

    def _start_endpoint(self) -> MetricsEndpoint | None:
        """The node's endpoint; a host whose ports are all taken costs metrics, not the agent."""
        config = self._settings.metrics
        if config.port is None:
            log.info("metrics_endpoint_disabled", reason="metrics_port=off")
            return None
        try:
            return MetricsEndpoint(
                host=config.host, port=config.port, parent_dir=config.parent_dir,
                run_id=self._run_id, port_given=config.port_given,
            )  # fmt: skip
        except MetricsPortsTakenError as exc:
            log.warning("metrics_endpoint_disabled", reason=str(exc))
            return None

    def _start_persister(self) -> None:
        """The writer of ``checkpoint.writer = "agent"`` checkpoints; before the zygote,
        whose workers inherit this environment."""
        try:
            self.persister = Persister().start()
        except OSError as exc:  # the workers then write their checkpoints themselves
            log.warning("checkpoint_persister_unavailable", reason=str(exc))
            return
        atexit.register(self.persister.close)
        os.environ[PERSIST_SOCKET_ENV] = str(self.persister.socket_path)

    def attach(self, handler: RendezvousHandler) -> NodeAgentHandler:
        """``handler`` with this agent around its rounds."""
        return NodeAgentHandler(handler, self)

    def _start_zygote(self) -> None:
        """Release the early zygote, else spawn one; the workers' environment is set by now."""
        if self.zygote is not None:
            self._release_early_zygote()
        if self.zygote is None and self._entry is not None:
            try:
                self.zygote = ZygoteProcess(self._entry, preload=self._settings.preload)
            except OSError as exc:  # a zygote that cannot start only costs speed
                log.warning("warm_start_unavailable", reason=str(exc))
                return
        if self.zygote is None:
            return
        atexit.register(self.zygote.close)
        os.environ[warm_start.SOCKET_ENV] = str(self.zygote.socket_path)
        log.info(
            "warm_start_zygote_started", pid=self.zygote.pid, socket=str(self.zygote.socket_path),
            forked_from_agent=self.zygote.forked,
        )  # fmt: skip

    def _release_early_zygote(self) -> None:
        zygote, self.zygote = self.zygote, None
        assert zygote is not None
        try:
            zygote.release(os.environ, preload=self._settings.preload)
        except OSError as exc:  # it died while importing: one is spawned instead
            log.warning("warm_start_zygote_died", pid=zygote.pid, reason=str(exc))
            zygote.close()
            return
        self.zygote = zygote

    def _replace_dead_zygote(self) -> None:
        """A zygote that died (a crash, the OOM killer) would turn every later start cold."""
        if self.zygote is None or self.zygote.proc.poll() is None:
            return
        code = self.zygote.proc.returncode
        log.warning("warm_start_zygote_died", pid=self.zygote.pid, exit_code=code)
        atexit.unregister(self.zygote.close)
        self.zygote.close()
        self.zygote = None
        if code == EXIT_UNSAFE_PRELOAD:  # its stderr, on this node's log, says which module
            log.warning("warm_start_disabled", reason="a preload module made forks unsafe")
            self._entry = None
            os.environ.pop(warm_start.SOCKET_ENV, None)
            return
        self._start_zygote()

    def next_round(self, handler: RendezvousHandler) -> RendezvousInfo:
        """One rendezvous round, counted and timed.

        Every round after the first is a restart of this node's workers; its
        start is when the agent began to recover, which the workers it spawns
        next receive in :data:`metrics.RECOVERY_STARTED_AT_ENV`.
        """
        node = metrics.node_name()
        if self._rounds:
            self._exit_on_config_error()
            self._replace_dead_zygote()  # it imports while the round runs
            os.environ[metrics.RECOVERY_STARTED_AT_ENV] = repr(time.time())
            metrics.RESTARTS.labels(node).inc()
            metrics.NODES.labels(node).set(0)
            metrics.WORLD_SIZE.labels(node).set(0)
        else:
            os.environ.pop(metrics.RECOVERY_STARTED_AT_ENV, None)
        start = time.perf_counter()
        info = handler.next_rendezvous()
        seconds = time.perf_counter() - start
        self._rounds += 1
        metrics.RDZV_ROUNDS.labels(node).inc()
        metrics.RDZV_SECONDS.labels(node).observe(seconds)
        metrics.NODES.labels(node).set(info.world_size)
        log.info(
            "rendezvous_joined", round=self._rounds, group_rank=info.rank,
            nodes=info.world_size, seconds=round(seconds, 3),
        )  # fmt: skip
        return info


class NodeAgentHandler(RendezvousHandler):
    """A rendezvous handler with the node agent around its rounds; the rest is delegated."""

    def __init__(self, inner: RendezvousHandler, agent: NodeAgent) -> None:
        self.inner = inner
        self.agent = agent

    def get_backend(self) -> str:
        return self.inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        return self.agent.next_round(self.inner)

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()
