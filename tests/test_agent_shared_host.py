"""Two torchrun agents on one host with default settings both train (issue 18 item 5).

Two jobs on a shared node (or the README quick start run twice) used to crash
the second agent: ``metrics_port=9402 ... Address already in use``. The
default port is held by this test first, so both agents must move, whatever
else on the machine holds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from trainer_procs import TINY_JOB

from elastic_train.agent.metrics_endpoint import DEFAULT_PORT, PORT_TRIES
from elastic_train.agent.warm_start import AGENT_PID_ENV, SOCKET_ENV

MAIN = Path(__file__).resolve().parents[1] / "elastic_train" / "main.py"
STEPS = 6


@contextlib.contextmanager
def _default_port_held() -> Iterator[bool]:
    """Listen on the default port, so no agent can have it; False if something else has it."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", DEFAULT_PORT))
            sock.listen()
        except OSError:
            yield False
            return
        yield True


def _agent(endpoint: str, run: Path, job: str, log: Path) -> subprocess.Popen[bytes]:
    """The README quick start's agent: no metrics key, no metrics variable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ELASTIC_TRAIN_METRICS") and k not in (SOCKET_ENV, AGENT_PID_ENV)
    }
    env |= {"ELASTIC_TRAIN_RDZV_SECRET": secrets.token_hex(32), "OMP_NUM_THREADS": "1"}
    env |= {"ELASTIC_TRAIN_NODE": job, "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
        "--max-restarts=0", "--rdzv-backend=etcd", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job}-{os.getpid()}-{secrets.token_hex(4)}", str(MAIN),
        *(f"--{o}" for o in TINY_JOB), f"--training.steps={STEPS}",
        f"--checkpoint.dir={run / 'ckpt'}", f"--logging.audit_dir={run / 'audit'}",
    ]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def _events(path: Path, name: str) -> list[dict]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("{")]
    return [e for e in map(json.loads, lines) if e.get("event") == name]


@pytest.mark.slow
def test_two_agents_on_one_host_with_default_metrics_settings_both_train(
    etcd_endpoint: str, tmp_path: Path
) -> None:
    jobs = ("jobA", "jobB")
    with _default_port_held() as held:
        agents = [
            _agent(etcd_endpoint, tmp_path / job, job, tmp_path / f"{job}.log") for job in jobs
        ]
        try:
            codes = [agent.wait(timeout=240) for agent in agents]
        finally:
            for agent in agents:
                if agent.poll() is None:
                    agent.terminate()  # torchrun stops its workers on SIGTERM
                    agent.wait(timeout=60)
    logs = {job: (tmp_path / f"{job}.log").read_text() for job in jobs}
    assert codes == [0, 0], {job: text[-3000:] for job, text in logs.items()}
    for job in jobs:
        result = json.loads((tmp_path / job / "audit" / "result.json").read_text())
        assert result["final_step"] == STEPS
    started = {job: _events(tmp_path / f"{job}.log", "metrics_endpoint_started") for job in jobs}
    ports = [events[0]["port"] for events in started.values()]
    # each agent served its own port, near the default one
    assert len(set(ports)) == 2 and all(
        DEFAULT_PORT <= p < DEFAULT_PORT + PORT_TRIES for p in ports
    ), ports
    if held:  # both had to move, and said so with the port actually served
        for job, port in zip(jobs, ports, strict=True):
            (taken,) = _events(tmp_path / f"{job}.log", "metrics_endpoint_port_taken")
            assert (taken["requested"], taken["port"]) == (DEFAULT_PORT, port)
            assert taken["level"] == "warning"  # the default port, not one the user gave
