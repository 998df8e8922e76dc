"""The node's Prometheus endpoint: one HTTP server per torchrun agent, merging its workers' files.

The endpoint lives in the agent, not in the workers, because torchrun restarts
every worker on each membership change: a per-worker server would flap and its
counters would reset. The endpoint creates a fresh directory per run, switches
prometheus-client to multiprocess mode over it and exports
``PROMETHEUS_MULTIPROC_DIR`` so that the workers the agent spawns afterwards
(torchrun copies the agent's ``os.environ`` into each worker) write their
metrics there (see ``docs/observability.md``).

Several agents on one host (two jobs on a shared node, two "nodes" of a local
run) ask for the same default port. A port in use is not fatal: the endpoint
serves the next free one of :data:`PORT_TRIES` ports upward, logged as
``metrics_endpoint_port_taken``, and the node agent serves no metrics (with a
warning) when every one is taken.
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import psutil
from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from elastic_train import metrics
from elastic_train.agent.settings import agent_setting
from elastic_train.errors import ConfigError, MetricsPortsTakenError
from elastic_train.log import get_logger

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

__all__ = [
    "DEFAULT_PORT",
    "PORT_TRIES",
    "MetricsEndpoint",
    "MetricsEndpointConfig",
]

log = get_logger(__name__)

DEFAULT_PORT = 9402
#: ports tried from the one asked for upward, when it is in use
PORT_TRIES = 32
_LIVE_GAUGE_FILE = re.compile(r"^gauge_live\w+_(\d+)\.db$")
#: How soon the server notices close(); socketserver's default, 0.5 s, was 0.4 s of
#: every agent's exit (py-spy). Idle, it is 20 wake-ups a second of one thread.
_STOP_POLL_S = 0.05


@dataclass(frozen=True)
class MetricsEndpointConfig:
    """Where the node's metrics endpoint listens; ``port=None`` turns it off.

    ``port_given``: the user set ``metrics_port`` (rather than taking the
    default), so serving another port is logged as an error, not a warning.
    """

    port: int | None = DEFAULT_PORT
    host: str = "0.0.0.0"
    parent_dir: Path | None = None
    port_given: bool = False

    @classmethod
    def from_params(
        cls, params: RendezvousParameters, environ: Mapping[str, str] = os.environ
    ) -> MetricsEndpointConfig:
        """From a ``RendezvousParameters``' config (rdzv-conf), falling back to ``environ``."""

        port, host, parent = (
            agent_setting(params, "metrics_port", environ),
            agent_setting(params, "metrics_host", environ),
            agent_setting(params, "metrics_dir", environ),
        )
        return cls(
            port=DEFAULT_PORT if port is None else parse_metrics_port(port),
            host=host or cls.host,
            parent_dir=Path(parent) if parent else None,
            port_given=port is not None,
        )


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

    def __init__(
        self,
        *,
        host: str,
        port: int,
        parent_dir: Path | None,
        run_id: str,
        port_given: bool = False,
        tries: int = PORT_TRIES,
    ) -> None:
        """Serve on ``port``, else the next free one of ``tries`` upward (0: any free port).

        :class:`MetricsPortsTakenError` when every one is in use; :class:`ConfigError`
        when the address cannot be served for another reason (a host not of this
        machine, a privileged port).
        """
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
            self._server, self._thread = _serve_first_free(
                registry, host=host, port=port, tries=tries, port_given=port_given
            )
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
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


def _serve_first_free(
    registry: CollectorRegistry, *, host: str, port: int, tries: int, port_given: bool
) -> tuple[WSGIServer, threading.Thread]:
    """:func:`_start_server` on ``port`` or the first free port above it (the OS boundary)."""
    last = port if port == 0 else min(port + tries - 1, 65535)
    for candidate in range(port, last + 1):
        try:
            served = _start_server(registry, host=host, port=candidate)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE and candidate < last:
                continue
            if exc.errno == errno.EADDRINUSE:
                raise MetricsPortsTakenError(
                    f"metrics_port: ports {port}-{last} on metrics_host={host!r} are all in use"
                ) from exc
            raise ConfigError(
                f"metrics_port={candidate} on metrics_host={host!r} cannot be "
                f"served ({exc.strerror or exc}); choose another metrics_port or "
                "metrics_host, 0 for a free port, or 'off'"
            ) from exc
        if candidate != port:
            # Prometheus targets that name `port` now reach another process, or none.
            report = log.error if port_given else log.warning
            report(
                "metrics_endpoint_port_taken", requested=port, port=candidate, host=host,
                port_given=port_given,
                hint="scrape the port logged here, or give each agent on this host its own "
                "metrics_port (0 picks a free one)",
            )  # fmt: skip
        return served
    raise AssertionError("not reached: the range holds at least one port")


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight does not hold the agent's exit


class _MetricsServer6(_MetricsServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line on stderr per scrape."""


def _start_server(
    registry: CollectorRegistry, *, host: str, port: int
) -> tuple[WSGIServer, threading.Thread]:
    """prometheus_client's ``start_http_server``, with a server that stops at once."""
    family, *_, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    server_class = _MetricsServer6 if family == socket.AF_INET6 else _MetricsServer
    server = make_server(
        address[0], port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler
    )
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": _STOP_POLL_S},
        name="metrics-endpoint", daemon=True,
    )  # fmt: skip
    thread.start()
    return server, thread
