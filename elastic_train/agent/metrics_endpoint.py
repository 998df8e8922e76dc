"""The node's Prometheus endpoint: one HTTP server per torchrun agent, merging its workers' files.

The endpoint lives in the agent, not in the workers, because torchrun restarts
every worker on each membership change: a per-worker server would flap and its
counters would reset. The endpoint creates a fresh directory per run, switches
prometheus-client to multiprocess mode over it and exports
``PROMETHEUS_MULTIPROC_DIR`` so that the workers the agent spawns afterwards
(torchrun copies the agent's ``os.environ`` into each worker) write their
metrics there (see ``docs/observability.md``).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from elastic_train import metrics
from elastic_train.errors import ConfigError
from elastic_train.log import get_logger

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

__all__ = ["DEFAULT_PORT", "MetricsEndpoint", "MetricsEndpointConfig", "agent_setting"]

log = get_logger(__name__)

DEFAULT_PORT = 9402
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
            agent_setting(params, "metrics_port", environ),
            agent_setting(params, "metrics_host", environ),
            agent_setting(params, "metrics_dir", environ),
        )
        return cls(
            port=DEFAULT_PORT if port is None else parse_metrics_port(port),
            host=host or cls.host,
            parent_dir=Path(parent) if parent else None,
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


def agent_setting(params: RendezvousParameters, key: str, environ: Mapping[str, str]) -> str | None:
    """An rdzv-conf key's value, else its ``ELASTIC_TRAIN_<KEY>`` variable, else None."""
    value = params.config.get(key)
    return str(value) if value is not None else environ.get(f"ELASTIC_TRAIN_{key.upper()}")
