"""etcd down for longer than the rendezvous lease's ttl: renewals fail loudly (a warning
and a counter), training goes on, and once the same etcd (data dir and port) is back
the job re-forms and finishes. Real etcd, real torchrun agents."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import structlog
from prometheus_client import REGISTRY

from elastic_train import metrics
from elastic_train.etcd.client import EtcdClient, EtcdClientConfig
from elastic_train.etcd.server import EtcdServer
from elastic_train.etcd.sync import LeaseKeeper

SCRIPT = Path(__file__).parent / "scripts" / "rdzv_train.py"
TTL_S = 2
FAILURES = "elastic_train_etcd_lease_renewal_failures_total"


def _poll(condition: Callable[[], bool], *, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        time.sleep(0.1)


def _failures() -> float:
    labels = {"node": metrics.node_name(), "op": "lease_keepalive"}
    return REGISTRY.get_sample_value(FAILURES, labels) or 0.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EtcdServer]:
    etcd = EtcdServer(data_dir=tmp_path / "etcd" / "data", name="outage").start()
    yield etcd
    etcd.stop()


def test_a_failed_lease_renewal_is_a_counted_warning(server: EtcdServer) -> None:
    client = EtcdClient(EtcdClientConfig(endpoints=(server.endpoint,), dial_timeout=0.5))
    key = f"/elastic_train/{uuid.uuid4().hex}/state".encode()
    keeper = LeaseKeeper(client, TTL_S)
    keeper.run(lambda lease: client.put(key, b"v", lease=lease))
    before = _failures()
    with structlog.testing.capture_logs() as logs:
        keeper.renew_in_background()
        server.stop()
        _poll(
            lambda: any(e["event"] == "lease_renewal_failed" for e in logs),
            within=10,
            what="a failed renewal is logged",
        )
        server.start()  # the same data dir and port
        _poll(lambda: client.get(key)[0] is not None, within=10, what="etcd answers again")
    keeper.stop_renewing()
    failed = [e for e in logs if e["event"] == "lease_renewal_failed"]
    assert {e["log_level"] for e in failed} == {"warning"}
    assert _failures() - before >= len(failed)
    # etcd restores its leases with a fresh ttl when it starts: the key outlived the outage.
    assert client.get(key)[0].value == b"v"  # type: ignore[union-attr]


def _records(out: Path) -> list[dict]:
    lines = (line for p in out.glob("steps-*.jsonl") for line in p.read_text().splitlines())
    return [json.loads(line) for line in lines if line]


def _last_step(out: Path) -> int:
    return max((r["step"] for r in _records(out)), default=0)


@pytest.fixture
def agents() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for agent in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(True)]
            for proc in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
        agent.wait()


@pytest.mark.slow
def test_the_job_resumes_after_etcd_was_down_longer_than_the_ttl(
    server: EtcdServer,
    rdzv_secret_file: Path,
    tmp_path: Path,
    agents: list[subprocess.Popen[bytes]],
) -> None:
    out, run_id = tmp_path / "out", uuid.uuid4().hex
    out.mkdir()
    conf = f"ttl={TTL_S},dial_timeout=1,join_timeout=60,metrics_port=off"
    conf += f",secret_file={rdzv_secret_file}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_TRAIN_", "TORCH"))}
    env["OMP_NUM_THREADS"] = "1"
    for i in range(2):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            "--max-restarts=3", "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={server.endpoint}",
            f"--rdzv-id={run_id}", f"--rdzv-conf={conf}", str(SCRIPT), str(out),
        ]  # fmt: skip
        with open(tmp_path / f"agent{i}.log", "wb") as log:
            agents.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    _poll(lambda: _last_step(out) >= 5, within=90, what="the job trains")

    server.stop()
    down_at, step_at_stop = time.monotonic(), _last_step(out)
    _poll(
        lambda: (
            time.monotonic() - down_at > TTL_S + 1
            and all("lease_renewal_failed" in p.read_text() for p in logs)
        ),
        within=30,
        what="every agent logs failed renewals for longer than the ttl",
    )
    assert _last_step(out) > step_at_stop, "training stopped while etcd was down"
    server.start()  # the same data dir and port
    down_s = time.monotonic() - down_at

    # A worker dies after the outage: the agents must re-form the round through etcd.
    first_workers = {p.name for p in out.glob("steps-*.jsonl")}
    worker = next(
        child
        for child in psutil.Process(agents[0].pid).children(recursive=True)
        if str(SCRIPT) in " ".join(child.cmdline())
    )
    os.kill(worker.pid, signal.SIGKILL)
    _poll(
        lambda: _steps_of_new_workers(out, first_workers) >= 6,
        within=90,
        what="the restarted workers train together",
    )
    (out / "release").touch()
    for agent, log in zip(agents, logs, strict=True):
        assert agent.wait(60) == 0, log.read_text()[-3000:]
    print(f"etcd down {down_s:.1f}s (ttl {TTL_S}s); the job re-formed and finished")


def _steps_of_new_workers(out: Path, old: set[str]) -> int:
    """Steps recorded at world size 2 by workers started after ``old`` ones."""
    return sum(
        1
        for path in out.glob("steps-*.jsonl")
        if path.name not in old
        for line in path.read_text().splitlines()
        if line and json.loads(line)["world_size"] == 2
    )
