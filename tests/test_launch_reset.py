"""``elastic-train rdzv reset``: a new job under a fixed run id (compose, Kubeflow) does
not meet the old job's closed rendezvous, against the real etcd and torch's handler."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rendezvous_threads import join_all
from secure_etcd import PASSWORD, secure_etcd
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from elastic_train.cli import EXIT_USAGE, main
from elastic_train.errors import ConfigError
from elastic_train.etcd.client import EtcdClient, EtcdClientConfig
from elastic_train.launch import run_key_prefix
from elastic_train.rendezvous.backend import EtcdV3RendezvousHandler, create_handler

RUN_ID = "job-1"


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # create_handler sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE; keep it out of other tests.
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.delenv("ETCD_USERNAME", raising=False)
    monkeypatch.delenv("ETCD_PASSWORD", raising=False)


@pytest.fixture
def client(etcd_endpoint: str) -> Iterator[EtcdClient]:
    client = EtcdClient(EtcdClientConfig(endpoints=(etcd_endpoint,)))
    yield client
    client.close()


def _handler(endpoint: str, prefix: str, secret_file: Path) -> EtcdV3RendezvousHandler:
    params = RendezvousParameters(
        backend="etcd-v3", endpoint=endpoint, run_id=RUN_ID, min_nodes=1, max_nodes=1,
        key_prefix=prefix, secret_file=str(secret_file),
    )  # fmt: skip
    return create_handler(params)


def _keys(client: EtcdClient, prefix: str) -> list[str]:
    return sorted(kv.key.decode() for kv in client.get_prefix(prefix.encode())[0])


def test_the_run_prefix_is_the_backends_and_ends_with_a_slash() -> None:
    assert run_key_prefix("/elastic-train/", "job-1") == b"/elastic-train/job-1/"
    assert run_key_prefix("/elastic_train", "job-1") == b"/elastic_train/job-1/"
    with pytest.raises(ConfigError, match="--key-prefix 'elastic' must be an absolute"):
        run_key_prefix("elastic", "job-1")
    with pytest.raises(ConfigError, match="--run-id is empty"):
        run_key_prefix("/p", " ")


@pytest.mark.slow
def test_reset_lets_a_new_job_with_the_same_run_id_rendezvous(
    etcd_endpoint: str, client: EtcdClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = f"/reset-{uuid.uuid4().hex[:8]}"
    secret_file = tmp_path / "secret"
    secret_file.write_text("s" * 64)
    # The old job: one round, then closed, as at the end of training.
    old = _handler(etcd_endpoint, prefix, secret_file)
    try:
        assert join_all([old], within=30) == [(0, 1)]
        old.set_closed()
    finally:
        old.shutdown()
    keys = _keys(client, f"{prefix}/{RUN_ID}/")
    assert f"{prefix}/{RUN_ID}/state" in keys
    assert any(k.startswith(f"{prefix}/{RUN_ID}/store/") for k in keys), keys
    # Other runs' keys, one of them a run id that starts with ours.
    others = [f"{prefix}/{RUN_ID}0/state", f"{prefix}/other/state", f"{prefix}-x/{RUN_ID}/state"]
    for key in others:
        client.put(key.encode(), b"keep")

    new = _handler(etcd_endpoint, prefix, secret_file)
    try:
        with pytest.raises(RendezvousClosedError):
            new.next_rendezvous()
    finally:
        new.shutdown()

    argv = ["rdzv", "reset", "--endpoint", etcd_endpoint, "--run-id", RUN_ID, "--key-prefix"]
    assert main([*argv, f"{prefix}/", "--dry-run"]) == 0
    assert _keys(client, f"{prefix}/{RUN_ID}/") == keys, "a dry run deletes nothing"
    assert main([*argv, f"{prefix}/"]) == 0
    printed = capsys.readouterr().out
    assert all(f"delete {key}" in printed for key in keys), printed
    assert _keys(client, f"{prefix}/{RUN_ID}/") == []
    assert all(client.get(key.encode())[0] is not None for key in others), "only this run's"

    fresh = _handler(etcd_endpoint, prefix, secret_file)
    try:
        assert join_all([fresh], within=30) == [(0, 1)]
    finally:
        fresh.shutdown()


def test_reset_names_a_bad_argument(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["rdzv", "reset", "--endpoint", "h:1", "--run-id", "r", "--key-prefix", "x"])
    assert code == EXIT_USAGE
    assert "--key-prefix 'x' must be an absolute" in capsys.readouterr().err
    code = main(["rdzv", "reset", "--endpoint", "h:1", "--run-id", "r", "--cert", "/nonexistent"])
    assert code == EXIT_USAGE
    assert "cert and key must be given together" in capsys.readouterr().err


@pytest.mark.slow
def test_reset_logs_in_with_tls_and_the_user_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # An etcd as deploy/etcd/ secures it: client certificates required, authentication on,
    # the rendezvous user limited to /elastic-train/.
    with secure_etcd(tmp_path) as etcd:
        certs = etcd.certs
        tls = EtcdClientConfig(
            endpoints=(etcd.server.endpoint,), protocol="https", cacert=str(certs / "ca.crt"),
            cert=str(certs / "client.crt"), key=str(certs / "client.key"),
            username="elastic-train", password=PASSWORD,
        )  # fmt: skip
        client = EtcdClient(tls)
        try:
            for key in ("/elastic-train/kf/state", "/elastic-train/kf/store/MASTER_ADDR"):
                client.put(key.encode(), b"old")
            client.put(b"/elastic-train/kf2/state", b"keep")
            argv = [
                "rdzv", "reset", "--endpoint", etcd.server.endpoint, "--run-id", "kf",
                "--key-prefix", "/elastic-train/", "--cacert", str(certs / "ca.crt"),
                "--cert", str(certs / "client.crt"), "--key", str(certs / "client.key"),
            ]  # fmt: skip
            monkeypatch.setenv("ETCD_USERNAME", "elastic-train")
            monkeypatch.setenv("ETCD_PASSWORD", "wrong")
            assert main(argv) == 1  # a wrong password is an etcd error, named
            assert "authentication failed" in capsys.readouterr().err
            monkeypatch.setenv("ETCD_PASSWORD", PASSWORD)
            assert main(argv) == 0
            assert PASSWORD not in "".join(capsys.readouterr())
            assert _keys(client, "/elastic-train/kf/") == []
            assert _keys(client, "/elastic-train/kf2/") == ["/elastic-train/kf2/state"]
        finally:
            client.close()
