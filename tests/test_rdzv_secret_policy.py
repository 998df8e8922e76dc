"""A job secret by default: no secret is a clear error, unsigned only with insecure=true
(warned at every start), and a short secret is refused; in-process and with torchrun."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import structlog
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_train.etcd.client import EtcdClient, EtcdClientConfig
from elastic_train.rendezvous import backend as rendezvous

SCRIPT = Path(__file__).parent / "scripts" / "ddp_minimal.py"
TRAIN_SCRIPT = Path(__file__).parent / "scripts" / "rdzv_train.py"


@pytest.fixture(autouse=True)
def _no_secret_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTIC_TRAIN_RDZV_SECRET", raising=False)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)


def _params(endpoint: str, **conf: object) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, uuid.uuid4().hex, 1, 1, **conf)


def test_no_secret_is_a_clear_error(etcd_endpoint: str) -> None:
    with pytest.raises(ValueError, match="no rendezvous secret") as info:
        rendezvous.create_handler(_params(etcd_endpoint))
    message = str(info.value)
    for named in ("secret_file", "ELASTIC_TRAIN_RDZV_SECRET", "insecure=true", "openssl rand"):
        assert named in message
    with pytest.raises(ValueError, match="no rendezvous secret"):
        rendezvous.create_backend(_params(etcd_endpoint))  # the Store is never unsigned either
    with pytest.raises(ValueError, match="no rendezvous secret"):
        rendezvous.create_handler(_params(etcd_endpoint, insecure="false"))


def test_insecure_runs_unsigned_and_warns_at_every_start(etcd_endpoint: str) -> None:
    client = EtcdClient(EtcdClientConfig(endpoints=(etcd_endpoint,)))
    for _ in range(2):
        params = _params(etcd_endpoint, insecure="true")
        with structlog.testing.capture_logs() as logs:
            handler = rendezvous.create_handler(params)
        warnings = [e for e in logs if e["event"] == "rendezvous_insecure"]
        assert [e["log_level"] for e in warnings] == ["warning"]
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        stored = client.get(f"/elastic_train/{params.run_id}/state".encode())[0]
        assert stored is not None and stored.value[4:5] == b"D"  # the unsigned framing
        handler.shutdown()
    client.close()


def test_a_secret_wins_over_insecure(etcd_endpoint: str, rdzv_secret_file: Path) -> None:
    params = _params(etcd_endpoint, insecure="true", secret_file=str(rdzv_secret_file))
    backend, _ = rendezvous.create_backend(params)
    backend.set_state(b"s")
    client = EtcdClient(EtcdClientConfig(endpoints=(etcd_endpoint,)))
    stored = client.get(f"/elastic_train/{params.run_id}/state".encode())[0]
    assert stored is not None and stored.value[4:5] == b"S"
    client.close()


@pytest.mark.parametrize("raw", ["yes", "1", "", "True!"])
def test_insecure_takes_only_true_or_false(raw: str) -> None:
    with pytest.raises(ValueError, match=f"insecure={raw!r}.*true, false"):
        rendezvous.create_handler(_params("127.0.0.1:2379", insecure=raw))


def test_a_short_secret_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    short = tmp_path / "short"
    short.write_text("correct horse battery staple\n")  # 28 bytes
    with pytest.raises(ValueError, match=r"secret_file=.*28 bytes.*at least 32") as info:
        rendezvous.create_handler(_params("127.0.0.1:2379", secret_file=str(short)))
    assert "openssl rand -hex 32" in str(info.value)
    assert "secrets.token_hex(32)" in str(info.value)
    monkeypatch.setenv("ELASTIC_TRAIN_RDZV_SECRET", "x" * 31)
    with pytest.raises(ValueError, match="ELASTIC_TRAIN_RDZV_SECRET is 31 bytes"):
        rendezvous.create_handler(_params("127.0.0.1:2379"))
    monkeypatch.setenv("ELASTIC_TRAIN_RDZV_SECRET", "x" * 32)
    rendezvous.create_backend(_params("127.0.0.1:2379"))  # 32 is enough


@pytest.mark.slow
def test_a_torchrun_agent_without_a_secret_stops_with_the_clear_error(
    etcd_endpoint: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_TRAIN_", "TORCH"))}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
        "--rdzv-backend=etcd", f"--rdzv-endpoint={etcd_endpoint}", f"--rdzv-id={uuid.uuid4().hex}",
        "--rdzv-conf=metrics_port=off", str(SCRIPT), "--out", str(tmp_path), "--steps", "1",
    ]  # fmt: skip
    agent = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert agent.returncode != 0
    assert "no rendezvous secret" in agent.stderr and "insecure=true" in agent.stderr
    assert not list(tmp_path.glob("steps-*.jsonl")), "a worker started"


def _steps(out: Path) -> list[dict]:
    lines = (line for p in out.glob("steps-*.jsonl") for line in p.read_text().splitlines())
    return [json.loads(line) for line in lines if line]


@pytest.mark.slow
def test_a_torchrun_agent_with_the_wrong_secret_is_refused_and_the_job_goes_on(
    etcd_endpoint: str, rdzv_secret_file: Path, tmp_path: Path
) -> None:
    out, run_id = tmp_path / "out", uuid.uuid4().hex
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_TRAIN_", "TORCH"))}
    env["OMP_NUM_THREADS"] = "1"

    def command(secret_file: Path) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2:3", "--nproc-per-node=1",
            "--rdzv-backend=etcd", f"--rdzv-endpoint={etcd_endpoint}", f"--rdzv-id={run_id}",
            f"--rdzv-conf=metrics_port=off,join_timeout=60,secret_file={secret_file}",
            str(TRAIN_SCRIPT), str(out),
        ]  # fmt: skip

    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    good = [
        subprocess.Popen(
            command(rdzv_secret_file), stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env
        )
        for log in logs
    ]
    try:
        deadline = time.monotonic() + 90
        while len([r for r in _steps(out) if r["world_size"] == 2]) < 6:
            assert all(a.poll() is None for a in good), logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, "the job never trained at world size 2"
            time.sleep(0.1)
        wrong_file = tmp_path / "wrong-secret"
        wrong_file.write_text(secrets.token_hex(32))
        wrong = subprocess.run(
            command(wrong_file), env=env, capture_output=True, text=True, timeout=120
        )
        assert wrong.returncode != 0
        assert f"/elastic_train/{run_id}/state" in wrong.stderr
        assert "HMAC does not match this agent's job secret" in wrong.stderr
        trained_before = len(_steps(out))
        deadline = time.monotonic() + 30
        while len(_steps(out)) < trained_before + 6:
            assert time.monotonic() < deadline, "the job stopped training"
            time.sleep(0.1)
        (out / "release").touch()
        for agent, log in zip(good, logs, strict=True):
            assert agent.wait(60) == 0, log.read_text()[-3000:]
        assert {r["world_size"] for r in _steps(out)} == {2}, "the refused node was admitted"
    finally:
        for agent in good:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
