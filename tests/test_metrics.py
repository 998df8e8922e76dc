"""Metrics: the worker API, and the agent's node endpoint with a real torchrun and etcd."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prom_tools import PROMTOOL, wait_for
from prometheus_client import REGISTRY, CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_train import metrics
from elastic_train.agent import metrics_endpoint
from elastic_train.agent.metrics_endpoint import PORT_TRIES, MetricsEndpoint, MetricsEndpointConfig
from elastic_train.agent.node_agent import AgentSettings, NodeAgent
from elastic_train.agent.warm_start import AGENT_PID_ENV
from elastic_train.errors import ConfigError, MetricsPortsTakenError
from elastic_train.etcd.server import free_port
from elastic_train.log import clear_context

NODE = metrics.node_name()


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"node": NODE, **labels}) or 0.0


@pytest.fixture
def worker() -> Iterator[metrics.WorkerMetrics]:
    started = metrics.WorkerMetrics(rank=0, local_rank=0, world_size=2, recovery_started_at=None)
    yield started
    started.close()


def test_step_completed_updates_training_series(worker: metrics.WorkerMetrics) -> None:
    before = (_value("elastic_train_samples_total"), _value("elastic_train_steps_total"))
    worker.step_completed(step=7, samples=16, seconds=0.25, loss=0.5, world_size=3)
    assert _value("elastic_train_samples_total") == before[0] + 16
    assert _value("elastic_train_steps_total") == before[1] + 1
    assert _value("elastic_train_global_step") == 7
    assert _value("elastic_train_loss") == 0.5
    assert _value("elastic_train_world_size") == 3
    assert _value("elastic_train_worker_resident_memory_bytes", local_rank="0") > 0


def test_step_series_are_written_at_most_every_flush_seconds_and_at_close() -> None:
    batched = metrics.WorkerMetrics(rank=0, local_rank=0, world_size=2, flush_seconds=3600)
    try:
        steps = _value("elastic_train_steps_total")
        count = _value("elastic_train_step_duration_seconds_count")
        batched.step_completed(step=1, samples=4, seconds=0.1, loss=2.0, world_size=2)
        assert _value("elastic_train_steps_total") == steps + 1  # the first at once
        for step in (2, 3):
            batched.step_completed(step=step, samples=4, seconds=0.1, loss=None, world_size=2)
        assert _value("elastic_train_steps_total") == steps + 1
        assert _value("elastic_train_global_step") == 1
    finally:
        batched.close()
    assert _value("elastic_train_steps_total") == steps + 3
    assert _value("elastic_train_step_duration_seconds_count") == count + 3
    assert _value("elastic_train_global_step") == 3
    assert _value("elastic_train_loss") == 2.0  # steps without a loss keep the last one


def test_job_level_counts_come_from_rank_0_only() -> None:
    other = metrics.WorkerMetrics(rank=1, local_rank=1, world_size=2)
    try:
        steps, lost = _value("elastic_train_steps_total"), _value("elastic_train_lost_steps_total")
        samples = _value("elastic_train_samples_total")
        other.resumed(restored_step=10, lost_steps=4)
        other.step_completed(step=11, samples=8, seconds=0.1, loss=1.0, world_size=2)
        assert _value("elastic_train_steps_total") == steps
        assert _value("elastic_train_lost_steps_total") == lost
        assert _value("elastic_train_samples_total") == samples + 8
    finally:
        other.close()


def test_recovery_is_measured_once_from_the_agents_start_time() -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    started_at = time.time() - 5.0
    restarted = metrics.WorkerMetrics.from_env(
        {**env, metrics.RECOVERY_STARTED_AT_ENV: repr(started_at)}
    )
    try:
        count = _value("elastic_train_recovery_seconds_count")
        total = _value("elastic_train_recovery_seconds_sum")
        restarted.resumed(restored_step=3, lost_steps=2)
        for step in (4, 5):
            restarted.step_completed(step=step, samples=4, seconds=0.1, loss=1.0, world_size=2)
        assert _value("elastic_train_recovery_seconds_count") == count + 1
        assert 5.0 <= _value("elastic_train_recovery_seconds_sum") - total < 60.0
    finally:
        restarted.close()


def test_etcd_timer_records_duration_and_errors() -> None:
    count = _value("elastic_train_etcd_request_duration_seconds_count", op="txn")
    errors = _value("elastic_train_etcd_request_errors_total", op="txn")
    with metrics.etcd_timer("txn"):
        pass
    with pytest.raises(TimeoutError), metrics.etcd_timer("txn"):
        raise TimeoutError
    assert _value("elastic_train_etcd_request_duration_seconds_count", op="txn") == count + 2
    assert _value("elastic_train_etcd_request_errors_total", op="txn") == errors + 1


def test_checkpoint_calls_set_the_last_good_checkpoint() -> None:
    metrics.checkpoint_saved(step=40, seconds=1.5, bytes_written=1000)
    assert _value("elastic_train_checkpoint_last_good_step") == 40
    metrics.checkpoint_loaded(step=30, seconds=0.2, saved_at=1_700_000_000.0)
    assert _value("elastic_train_checkpoint_last_good_step") == 30
    assert _value("elastic_train_checkpoint_last_good_timestamp_seconds") == 1_700_000_000.0


def _params(**conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", "127.0.0.1:2379", "run", 1, 2, **conf)


def test_endpoint_settings_rdzv_conf_wins_over_environment() -> None:
    env = {"ELASTIC_TRAIN_METRICS_PORT": "9500", "ELASTIC_TRAIN_METRICS_HOST": "127.0.0.1"}
    assert MetricsEndpointConfig.from_params(_params(), env) == MetricsEndpointConfig(
        port=9500, host="127.0.0.1", port_given=True
    )
    config = MetricsEndpointConfig.from_params(_params(metrics_port="off"), env)
    assert config.port is None and config.host == "127.0.0.1"
    assert MetricsEndpointConfig.from_params(_params(), {}) == MetricsEndpointConfig(
        port=9402, host="0.0.0.0"
    )


@pytest.mark.parametrize("port", ["http", "70000", "-1"])
def test_bad_metrics_port_is_refused_naming_the_key(port: str) -> None:
    with pytest.raises(ConfigError, match=r"metrics_port=.*0-65535.*'off'"):
        MetricsEndpointConfig.from_params(_params(metrics_port=port), {})


def _occupy(count: int) -> list[socket.socket]:
    """``count`` consecutive loopback ports, each held by a real listening socket."""
    for _ in range(50):
        base, held = free_port(), []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
                sock.listen()
            return held
        except OSError:
            for sock in held:
                sock.close()
    raise AssertionError(f"no {count} consecutive free ports")


def test_a_busy_port_moves_the_endpoint_to_the_next_free_one() -> None:
    """What a second agent on the host meets: the endpoint serves the next free port."""
    (busy,) = _occupy(1)
    requested = busy.getsockname()[1]
    registry = CollectorRegistry()
    Gauge("probe", "a value only this endpoint serves", registry=registry).set(42)
    try:
        with capture_logs() as logs:
            server, _ = metrics_endpoint._serve_first_free(
                registry, host="127.0.0.1", port=requested, tries=PORT_TRIES, port_given=True
            )
    finally:
        busy.close()
    try:
        port = server.server_port
        assert requested < port < requested + PORT_TRIES
        assert _samples(_scrape(port))[("probe", ())] == 42
        (taken,) = [e for e in logs if e["event"] == "metrics_endpoint_port_taken"]
        # the user insisted on that port: said loudly, with the port actually served
        assert (taken["log_level"], taken["requested"], taken["port"]) == ("error", requested, port)
    finally:
        server.shutdown()
        server.server_close()


def test_every_port_taken_turns_metrics_off_and_the_agent_lives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No dead agent: NodeAgent.start serves no metrics, says why, and leaves nothing behind."""
    exported = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    monkeypatch.setenv(AGENT_PID_ENV, "0")  # start() exports its own; restored afterwards
    held = _occupy(PORT_TRIES)
    first, last = held[0].getsockname()[1], held[-1].getsockname()[1]
    try:
        with pytest.raises(MetricsPortsTakenError, match=f"ports {first}-{last}"):
            MetricsEndpoint(host="127.0.0.1", port=first, parent_dir=tmp_path, run_id="r")
        config = MetricsEndpointConfig(port=first, host="127.0.0.1", parent_dir=tmp_path)
        agent = NodeAgent(AgentSettings(metrics=config), run_id="r", argv=[])
        with capture_logs() as logs:
            agent.start(min_nodes=1, max_nodes=1)
    finally:
        clear_context()  # start() binds run_id and node to every later event of this process
        for sock in held:
            sock.close()
    assert agent.endpoint is None
    (disabled,) = [e for e in logs if e["event"] == "metrics_endpoint_disabled"]
    assert disabled["log_level"] == "warning" and f"ports {first}-{last}" in disabled["reason"]
    assert list(tmp_path.iterdir()) == []
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") == exported  # not switched


def test_a_port_that_cannot_be_served_for_another_reason_is_a_config_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"metrics_port=\d+ on metrics_host='192\.0\.2\.1'"):
        MetricsEndpoint(host="192.0.2.1", port=free_port(), parent_dir=tmp_path, run_id="r")
    assert list(tmp_path.iterdir()) == []


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.slow
def test_agent_endpoint_keeps_counting_across_a_worker_restart(
    etcd_endpoint: str, tmp_path: Path, rdzv_secret_file: Path
) -> None:
    """One torchrun agent (2 workers) whose group fails once and restarts."""
    parent = tmp_path / "metrics-parent"
    parent.mkdir()
    (parent / "not-ours.txt").write_text("must survive")
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    conf = f"metrics_port={port},metrics_host=127.0.0.1,metrics_dir={parent}"
    conf += f",secret_file={rdzv_secret_file}"
    env = {**os.environ, "ELASTIC_TRAIN_NODE": "nodeA", "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
        "--max-restarts=1", "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={etcd_endpoint}",
        f"--rdzv-id=metrics-{port}", f"--rdzv-conf={conf}",
        str(Path(__file__).with_name("metrics_worker.py")), str(out),
    ]  # fmt: skip
    with open(tmp_path / "agent.log", "wb") as log:
        agent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: len(list(out.glob("worker-1-*.json"))) == 2, timeout=60, what="workers")
        reports = [json.loads(p.read_text()) for p in sorted(out.glob("worker-1-*.json"))]
        text = _scrape(port)
        values = _samples(text)
        node = (("node", "nodeA"),)
        # 3 steps before the crash and 3 after: the dead worker's counts were kept
        assert values[("elastic_train_steps_total", node)] == 6
        assert values[("elastic_train_samples_total", node)] == 2 * 6 * 4
        assert values[("elastic_train_restarts_total", node)] == 1
        assert values[("elastic_train_rendezvous_rounds_total", node)] == 2
        assert values[("elastic_train_rendezvous_duration_seconds_count", node)] == 2
        assert values[("elastic_train_recovery_seconds_count", node)] == 1
        assert values[("elastic_train_world_size", node)] == 2
        assert values[("elastic_train_min_nodes", node)] == 1
        # the workers wrote into the agent's fresh directory under metrics_dir ...
        (directory,) = {Path(r["dir"]) for r in reports}
        assert directory.parent == parent
        # ... where only live workers keep their 'live' gauge files
        live = sorted(int(p.stem.rsplit("_", 1)[1]) for p in directory.glob("gauge_live*_*.db"))
        assert sorted(set(live)) == sorted(r["pid"] for r in reports)
        if PROMTOOL is not None:
            check = subprocess.run(
                [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True
            )
            assert check.returncode == 0, check.stdout + check.stderr
        (out / "release").touch()
        assert agent.wait(timeout=60) == 0
    finally:
        # The workers run in their own sessions: let them exit before the agent goes.
        (out / "release").touch()
        if agent.poll() is None:
            agent.terminate()  # torchrun stops its workers on SIGTERM
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
    assert not directory.exists(), "the agent removes the directory it created"
    assert (parent / "not-ours.txt").read_text() == "must survive"


@pytest.mark.slow  # imports torch in a fresh process
def test_importing_the_node_agent_first_keeps_the_torchrun_handlers_loadable() -> None:
    """torch's rendezvous package loads our entry points; node_agent must not import it."""
    child = (
        "import elastic_train.agent.node_agent\n"
        "from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry as r\n"
        "import torch.distributed.elastic.rendezvous.registry\n"
        "print(sorted(r._registry))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=True
    )
    assert "Exception while registering" not in proc.stderr, proc.stderr
    assert "'etcd-v3'" in proc.stdout
