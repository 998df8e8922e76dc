"""torchrun agents training through the etcd v3 rendezvous, against a stock etcd (v2 API off)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from elastic_train.etcd.server import EtcdServer

SCRIPT = Path(__file__).parent / "scripts" / "ddp_minimal.py"
STEPS = 12
NNODES = "1:2"
#: The job secret every agent of these tests signs the rendezvous with.
RDZV_SECRET = secrets.token_hex(32)
pytestmark = pytest.mark.slow


class Agent:
    """One torchrun agent ("node") in its own session, its output in a file."""

    def __init__(self, out: Path, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.log_path = out / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"agent did not finish in {timeout}s:\n{self.output()[-3000:]}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """Kill the agent and its workers (torchrun starts them in their own sessions)."""
        try:
            tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]
        except psutil.NoSuchProcess:
            return
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        self.proc.wait()


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for agent in started:
        agent.kill()


def _start(
    agents: list[Agent], out: Path, backend: str, endpoint: str, run_id: str, *script_args: str
) -> Agent:
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", NNODES, "--nproc-per-node", "1", "--max-restarts", "3",
        "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf", "join_timeout=60,metrics_port=off",
        str(SCRIPT), "--out", str(out), "--steps", str(STEPS), *script_args,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_TRAIN_", "TORCH"))}
    env["OMP_NUM_THREADS"] = "1"
    env["ELASTIC_TRAIN_RDZV_SECRET"] = RDZV_SECRET
    agent = Agent(out, f"agent{len(agents)}", cmd, env)
    agents.append(agent)
    return agent


def _records(out: Path) -> list[dict]:
    return [
        json.loads(line)
        for p in out.glob("steps-*.jsonl")
        for line in p.read_text().splitlines()
        if line
    ]


def _assert_finished_at_world_size_two(out: Path, agents: list[Agent]) -> None:
    for agent in agents:
        assert agent.wait(120) == 0, agent.output()[-3000:]
    last = [r for r in _records(out) if r["step"] == STEPS]
    assert sorted((r["rank"], r["world_size"]) for r in last) == [(0, 2), (1, 2)]


def test_stock_etcd_has_v2_off(etcd_server: EtcdServer) -> None:
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"{etcd_server.client_url}/v2/keys", timeout=5)


def test_two_agents_train_to_the_end(
    etcd_endpoint: str, agents: list[Agent], tmp_path: Path
) -> None:
    """torchrun's own ``etcd`` name reaches our v3 backend (the README's launch);
    ``etcd-v3``, the name of ours alone, trains in the test below."""
    run_id = uuid.uuid4().hex
    for _ in range(2):
        _start(agents, tmp_path, "etcd", etcd_endpoint, run_id, "--hold-until-world-size", "2")
    _assert_finished_at_world_size_two(tmp_path, agents)
    assert [a.output().count("etcd_backend_takeover") for a in agents] == [1, 1]


def test_node_joins_a_running_job(etcd_endpoint: str, agents: list[Agent], tmp_path: Path) -> None:
    """Regression: with torch's shared TCPStore a joiner hangs (rank 0 does not republish
    MASTER_ADDR/PORT); our handler creator turns the sharing off."""
    run_id = uuid.uuid4().hex
    hold = ("--hold-until-world-size", "2")
    _start(agents, tmp_path, "etcd-v3", etcd_endpoint, run_id, *hold)
    deadline = time.monotonic() + 90
    while not any(r["world_size"] == 1 for r in _records(tmp_path)):
        assert agents[0].proc.poll() is None, agents[0].output()[-3000:]
        assert time.monotonic() < deadline, "the first node never trained alone"
        time.sleep(0.2)
    joined_at = time.monotonic()
    _start(agents, tmp_path, "etcd-v3", etcd_endpoint, run_id, *hold)
    while not any(r["world_size"] == 2 for r in _records(tmp_path)):
        assert all(a.proc.poll() is None for a in agents), agents[-1].output()[-3000:]
        assert time.monotonic() - joined_at < 60, "the joiner never trained"
        time.sleep(0.2)
    print(f"joiner training {time.monotonic() - joined_at:.1f}s after its agent started")
    _assert_finished_at_world_size_two(tmp_path, agents)
    sizes = [r["world_size"] for r in _records(tmp_path) if r["rank"] == 0]
    assert 1 in sizes
    assert not any("etcd_backend_takeover" in a.output() for a in agents)  # our name: no takeover
