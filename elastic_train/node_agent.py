"""Code that runs inside the long-lived torchrun agent process.

The rendezvous handler creator calls :func:`wrap_handler` once per agent. It
starts the node's metrics endpoint and times every rendezvous round.

The endpoint lives in the agent, not in the workers, because torchrun restarts
every worker on each membership change: a per-worker server would flap and its
counters would reset. The agent creates a fresh directory per run, switches
prometheus-client to multiprocess mode over it and exports
``PROMETHEUS_MULTIPROC_DIR`` so that the workers it spawns afterwards (torchrun
copies the agent's ``os.environ`` into each worker) write their metrics there.
One HTTP server serves the merged view (see ``docs/observability.md``).

Settings, each an ``--rdzv-conf`` key, else an environment variable, else the
default (the key wins, so a command line says what it does):

=================  ===============================  =================================
rdzv-conf key      environment variable             default
=================  ===============================  =================================
``metrics_port``   ``ELASTIC_TRAIN_METRICS_PORT``   ``9402``; ``0`` picks a free port;
                                                    ``off`` serves nothing
``metrics_host``   ``ELASTIC_TRAIN_METRICS_HOST``   ``0.0.0.0`` (all interfaces)
``metrics_dir``    ``ELASTIC_TRAIN_METRICS_DIR``    the system temporary directory
``warm_start``     ``ELASTIC_TRAIN_WARM_START``     ``1`` on Linux, else ``0``; also
                                                    ``true``/``false``/``on``/``off``
=================  ===============================  =================================

``metrics_dir`` is the *parent* of the per-run directory; only the per-run
directory, which this process made, is ever deleted.

With ``warm_start`` on, an agent whose command line runs ``elastic_train/main.py``
(by path or ``-m elastic_train.main``) also starts the node's zygote
(:mod:`elastic_train.zygote`): a child process that has imported torch and the
trainer, from which each worker start forks instead of importing all of it
again (``docs/warm-start.md``). Its socket is in a private per-run directory
exported to the workers as ``ELASTIC_TRAIN_WARM_START_SOCKET``.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from elastic_train import metrics, warm_start
from elastic_train.errors import ConfigError
from elastic_train.log import (
    bind_context,
    configure_logging_if_unconfigured,
    get_logger,
    register_secret,
)
from elastic_train.zygote import ZygoteProcess

__all__ = ["RDZV_CONF_KEYS", "MetricsEndpoint", "MetricsEndpointConfig", "wrap_handler"]

if TYPE_CHECKING:
    # Not at run time: importing torch's rendezvous package loads the torchrun
    # entry points, i.e. elastic_train.rendezvous, which imports this module.
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousParameters,
    )

log = get_logger(__name__)

DEFAULT_PORT = 9402
#: The ``--rdzv-conf`` keys read here; a backend that validates its keys accepts these.
RDZV_CONF_KEYS = frozenset({"metrics_port", "metrics_host", "metrics_dir", "warm_start"})
_LIVE_GAUGE_FILE = re.compile(r"^gauge_live\w+_(\d+)\.db$")


@dataclass(frozen=True)
class MetricsEndpointConfig:
    """Where the node's metrics endpoint listens; ``port=None`` turns it off."""

    port: int | None = DEFAULT_PORT
    host: str = "0.0.0.0"
    parent_dir: Path | None = None

    @classmethod
    def from_params(
        cls, params: RendezvousParameters, environ: Mapping[str, str] = os.environ
    ) -> MetricsEndpointConfig:
        """From a ``RendezvousParameters``' config (rdzv-conf), falling back to ``environ``."""

        port, host, parent = (
            _setting(params, "metrics_port", environ),
            _setting(params, "metrics_host", environ),
            _setting(params, "metrics_dir", environ),
        )
        return cls(
            port=DEFAULT_PORT if port is None else parse_metrics_port(port),
            host=host or cls.host,
            parent_dir=Path(parent) if parent else None,
        )


def _setting(params: RendezvousParameters, key: str, environ: Mapping[str, str]) -> str | None:
    """An rdzv-conf key's value, else its ``ELASTIC_TRAIN_<KEY>`` variable, else None."""
    value = params.config.get(key)
    return str(value) if value is not None else environ.get(f"ELASTIC_TRAIN_{key.upper()}")


def warm_start_enabled(
    params: RendezvousParameters, environ: Mapping[str, str] = os.environ
) -> bool:
    """The ``warm_start`` setting; on by default where it works (Linux)."""
    text = _setting(params, "warm_start", environ)
    if text is None:
        return sys.platform == "linux"
    try:
        enabled = warm_start.parse_warm_start(text)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if enabled and sys.platform != "linux":
        log.warning("warm_start_unsupported", platform=sys.platform, hint="Linux only")
        return False
    return enabled


def parse_metrics_port(text: str) -> int | None:
    """A metrics port: 0-65535 (0 picks a free port), or None for 'off'."""
    if text.strip().lower() == "off":
        return None
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(
            f"metrics_port={text!r} is invalid: expected an integer 0-65535 "
            "(0 picks a free port) or 'off'"
        )
    return port


class _NodeCollector:
    """Merges the metric files of every process of this node that ever wrote one."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory

    def collect(self) -> Iterator[Metric]:
        # 'live*' gauges must forget dead workers; the agent is the one process
        # that outlives them, so it does the bookkeeping, just before reading.
        for path in self._directory.iterdir():
            match = _LIVE_GAUGE_FILE.match(path.name)
            if match and not psutil.pid_exists(int(match.group(1))):
                mark_process_dead(int(match.group(1)), str(self._directory))
        yield from MultiProcessCollector(None, path=str(self._directory)).collect()


class MetricsEndpoint:
    """The node's scrape endpoint: a fresh multiprocess directory and an HTTP server."""

    def __init__(self, *, host: str, port: int, parent_dir: Path | None, run_id: str) -> None:
        safe_run_id = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:64]
        if parent_dir is not None:
            parent_dir.mkdir(parents=True, exist_ok=True)
        self.directory = Path(
            tempfile.mkdtemp(prefix=f"elastic-train-metrics-{safe_run_id}-", dir=parent_dir)
        )
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_NodeCollector(self.directory))
        ProcessCollector(registry=registry)  # the agent's own process_* metrics
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise ConfigError(
                f"metrics_port={port} on metrics_host={host!r} cannot be "
                f"served ({exc.strerror or exc}); choose another metrics_port, 0 for a free "
                "one, or 'off'"
            ) from exc
        inherited = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if inherited:
            # Not ours to clear or share: our workers get our own directory instead.
            log.warning("metrics_multiproc_dir_replaced", inherited=inherited)
        # Only once the endpoint is sure: this switch cannot be undone.
        metrics.enable_multiprocess(self.directory)
        self.host = host
        self.port: int = self._server.server_port
        atexit.register(self.close)
        log.info(
            "metrics_endpoint_started",
            host=self.host,
            port=self.port,
            directory=str(self.directory),
        )

    def close(self) -> None:
        """Stop serving and delete the directory this endpoint created (and only that)."""
        self._server.shutdown()
        self._server.server_close()
        shutil.rmtree(self.directory, ignore_errors=True)
        atexit.unregister(self.close)


_endpoint: MetricsEndpoint | None = None


def _endpoint_once(config: MetricsEndpointConfig, *, run_id: str) -> MetricsEndpoint | None:
    """One endpoint per agent process, even if a handler is created twice."""
    global _endpoint
    if _endpoint is None and config.port is not None:
        _endpoint = MetricsEndpoint(
            host=config.host, port=config.port, parent_dir=config.parent_dir, run_id=run_id
        )
    return _endpoint


_zygote: ZygoteProcess | None = None


def _zygote_once(enabled: bool, argv: Sequence[str]) -> None:
    """One zygote per agent process; a zygote that cannot start only costs speed."""
    global _zygote
    if _zygote is not None:
        return
    if not enabled:
        log.info("warm_start_disabled", reason="warm_start=0")
        return
    if not runs_our_trainer(argv):
        # Another script has no use for it; nor has a process that creates
        # handlers itself (tests, the rendezvous benchmark): no import of torch
        # to pay for, no socket variable left in its environment.
        log.info("warm_start_disabled", reason="the workers do not run elastic_train/main.py")
        return
    try:
        _zygote = ZygoteProcess()
    except OSError as exc:
        log.warning("warm_start_unavailable", reason=str(exc))
        return
    atexit.register(_zygote.close)
    os.environ[warm_start.SOCKET_ENV] = str(_zygote.socket_path)
    log.info("warm_start_zygote_started", pid=_zygote.pid, socket=str(_zygote.socket_path))


def _replace_dead_zygote() -> None:
    """A zygote that died (a crash, the OOM killer) would turn every later start cold."""
    global _zygote
    if _zygote is None or _zygote.proc.poll() is None:
        return
    log.warning("warm_start_zygote_died", pid=_zygote.pid, exit_code=_zygote.proc.returncode)
    atexit.unregister(_zygote.close)
    _zygote.close()
    _zygote = None
    _zygote_once(True, sys.argv)


def runs_our_trainer(argv: Sequence[str]) -> bool:
    """Whether a torchrun command line starts ``elastic_train/main.py`` (by path or ``-m``)."""
    main = Path(__file__).with_name("main.py").resolve()
    return "elastic_train.main" in argv or any(
        Path(arg).resolve() == main for arg in argv if arg.endswith("main.py")
    )


class _TimedRendezvous:
    """Wraps ``next_rendezvous``: counts and times rounds and restarts.

    Every round after the first is a restart of this node's workers; its start
    is when the agent began to recover, which the workers it spawns next
    receive in :data:`metrics.RECOVERY_STARTED_AT_ENV`.
    """

    def __init__(self, next_rendezvous: Callable[[], RendezvousInfo]) -> None:
        self._next_rendezvous = next_rendezvous
        self._rounds = 0
        node = metrics.node_name()
        self._restarts, self._world_size = (
            metrics.RESTARTS.labels(node),
            metrics.WORLD_SIZE.labels(node),
        )
        self._nodes, self._rounds_total = (
            metrics.NODES.labels(node),
            metrics.RDZV_ROUNDS.labels(node),
        )
        self._seconds = metrics.RDZV_SECONDS.labels(node)
        self._nodes.set(0)  # not in a round yet: a first round that never completes alerts too

    def __call__(self) -> RendezvousInfo:
        if self._rounds:
            _replace_dead_zygote()  # it imports while the round runs
            os.environ[metrics.RECOVERY_STARTED_AT_ENV] = repr(time.time())
            self._restarts.inc()
            self._nodes.set(0)
            self._world_size.set(0)
        else:
            os.environ.pop(metrics.RECOVERY_STARTED_AT_ENV, None)
        start = time.perf_counter()
        info = self._next_rendezvous()
        seconds = time.perf_counter() - start
        self._rounds += 1
        self._rounds_total.inc()
        self._seconds.observe(seconds)
        self._nodes.set(info.world_size)
        log.info(
            "rendezvous_joined",
            round=self._rounds,
            group_rank=info.rank,
            nodes=info.world_size,
            seconds=round(seconds, 3),
        )
        return info


def wrap_handler(handler: RendezvousHandler, params: RendezvousParameters) -> RendezvousHandler:
    """Start the node's metrics endpoint and time ``handler``'s rounds; returns ``handler``."""
    configure_logging_if_unconfigured()
    register_secret(params.config.get("password"))
    config = MetricsEndpointConfig.from_params(params)
    node = metrics.node_name()
    bind_context(run_id=params.run_id, node=node)
    if _endpoint_once(config, run_id=params.run_id) is None:
        log.info("metrics_endpoint_disabled")
    # After the endpoint: the zygote's imports must see PROMETHEUS_MULTIPROC_DIR.
    _zygote_once(warm_start_enabled(params), sys.argv)
    metrics.MIN_NODES.labels(node).set(params.min_nodes)
    metrics.MAX_NODES.labels(node).set(params.max_nodes)
    # An instance attribute shadows the method: the handler keeps its type and
    # every other attribute torchrun reads (use_agent_store, get_backend, ...).
    handler.next_rendezvous = _TimedRendezvous(handler.next_rendezvous)  # type: ignore[method-assign]
    return handler
