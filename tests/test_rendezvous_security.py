"""TLS with client certificates, a prefix-limited etcd role, and signed rendezvous state,
each against a real etcd."""

from __future__ import annotations

import pickle
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)

from elastic_train.errors import EtcdError
from elastic_train.etcd.client import EtcdClient, EtcdClientConfig
from elastic_train.etcd.server import EtcdServer, find_etcd_binary
from elastic_train.rendezvous import backend as rendezvous
from elastic_train.rendezvous.backend import create_backend
from elastic_train.rendezvous.keys import EtcdV3RendezvousBackend

PASSWORD = "trainer-pw-0xf00d"


def _params(endpoint: str, run_id: str | None = None, **conf: object) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd-v3",
        endpoint=endpoint,
        run_id=run_id or uuid.uuid4().hex,
        min_nodes=1,
        max_nodes=1,
        **{"dial_timeout": 2, **conf},
    )


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, rdzv_secret: str) -> None:
    # Every backend here signs with the session's job secret (rdzv_secret, in the
    # environment) unless a test says otherwise.
    for name in ("ETCD_USERNAME", "ETCD_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)


# -- TLS ------------------------------------------------------------------------------------------


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _make_ca(d: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.crt"),
        "-subj", f"/CN={name}", "-days", "1",
    )  # fmt: skip


def _make_cert(d: Path, name: str, ca: str, usage: str) -> None:
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usage}\n")
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"), "-subj", f"/CN={name}",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / f"{ca}.crt"),
        "-CAkey", str(d / f"{ca}.key"), "-CAcreateserial", "-out", str(d / f"{name}.crt"),
        "-days", "1", "-extfile", str(ext),
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA with a server and a client certificate, and an unrelated CA."""
    d = tmp_path_factory.mktemp("pki")
    _make_ca(d, "ca")
    _make_cert(d, "server", "ca", "serverAuth")
    _make_cert(d, "client", "ca", "clientAuth")
    _make_ca(d, "other-ca")
    return d


@pytest.fixture(scope="module")
def tls_server(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    root = tmp_path_factory.mktemp("etcd-tls")
    server = EtcdServer(
        data_dir=root / "data",
        name="tls",
        client_scheme="https",
        extra_args=[
            f"--cert-file={pki / 'server.crt'}",
            f"--key-file={pki / 'server.key'}",
            f"--trusted-ca-file={pki / 'ca.crt'}",
            "--client-cert-auth",
        ],
    ).start()
    yield server
    server.stop()


def _tls_conf(pki: Path, **overrides: object) -> dict[str, object]:
    conf: dict[str, object] = {
        "protocol": "https",
        "cacert": str(pki / "ca.crt"),
        "cert": str(pki / "client.crt"),
        "key": str(pki / "client.key"),
    }
    conf.update(overrides)
    return {k: v for k, v in conf.items() if v is not None}


def test_tls_with_client_certificate(pki: Path, tls_server: EtcdServer) -> None:
    backend, store = create_backend(_params(tls_server.endpoint, **_tls_conf(pki)))
    _, token, written = backend.set_state(b"over tls")
    assert written and backend.get_state() == (b"over tls", token)
    store.set("k", b"v")
    assert store.get("k") == b"v"


@pytest.mark.parametrize(
    "overrides",
    [
        {"cert": None, "key": None},  # the server demands a client certificate
        {"cacert": "other-ca.crt"},  # the server's certificate is not trusted
        {"protocol": "http", "cacert": None, "cert": None, "key": None},
    ],
    ids=["no-client-cert", "untrusted-server", "plain-http"],
)
def test_tls_failures_are_clear_and_bounded(
    pki: Path, tls_server: EtcdServer, overrides: dict[str, object]
) -> None:
    overrides = {k: str(pki / v) if k == "cacert" and v else v for k, v in overrides.items()}
    backend, _ = create_backend(_params(tls_server.endpoint, **_tls_conf(pki, **overrides)))
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=tls_server.endpoint) as info:
        backend.get_state()
    assert time.monotonic() - start < 2 + 1.0  # dial_timeout=2
    assert isinstance(info.value.__cause__, EtcdError)


# -- authentication ----------------------------------------------------------------------


def _etcdctl(endpoint: str, *args: str) -> None:
    etcdctl = str(Path(find_etcd_binary()).with_name("etcdctl"))
    subprocess.run(
        [etcdctl, f"--endpoints=http://{endpoint}", *args],
        check=True,
        capture_output=True,
        timeout=30,
    )


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """etcd with auth on and a user ``trainer`` whose role may only touch ``/elastic_train/``."""
    server = EtcdServer(
        data_dir=tmp_path_factory.mktemp("etcd-auth") / "data",
        name="auth",
        extra_args=["--auth-token-ttl=1"],  # tokens expire fast, so re-login is tested
    )
    server.start()
    ep = server.endpoint
    _etcdctl(ep, "user", "add", "root", "--new-user-password=root-pw")
    _etcdctl(ep, "user", "grant-role", "root", "root")
    _etcdctl(ep, "role", "add", "trainer")
    _etcdctl(
        ep, "role", "grant-permission", "trainer", "--prefix=true", "readwrite", "/elastic_train/"
    )
    _etcdctl(ep, "user", "add", "trainer", f"--new-user-password={PASSWORD}")
    _etcdctl(ep, "user", "grant-role", "trainer", "trainer")
    _etcdctl(ep, "auth", "enable")
    yield server
    server.stop()


def test_prefix_limited_role_runs_a_rendezvous(
    auth_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ETCD_USERNAME", "trainer")
    monkeypatch.setenv("ETCD_PASSWORD", PASSWORD)
    handler = rendezvous.create_handler(_params(auth_server.endpoint))
    info = handler.next_rendezvous()  # state, lease, store (MASTER_ADDR) all under the prefix
    assert (info.rank, info.world_size) == (0, 1)
    assert info.store.get("MASTER_PORT")
    assert handler.shutdown()


def test_expired_token_is_renewed(auth_server: EtcdServer) -> None:
    config = EtcdClientConfig(
        endpoints=(auth_server.endpoint,), username="trainer", password=PASSWORD
    )
    client = EtcdClient(config)
    client.put(b"/elastic_train/token-test", b"1")
    time.sleep(2.5)  # let the server forget the token (--auth-token-ttl=1)
    client.put(b"/elastic_train/token-test", b"2")
    assert client.get(b"/elastic_train/token-test")[0].value == b"2"


def test_wrong_password_is_a_clear_connection_error(
    auth_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ETCD_USERNAME", "trainer")
    monkeypatch.setenv("ETCD_PASSWORD", "wrong")
    backend, _ = create_backend(_params(auth_server.endpoint))
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"{auth_server.endpoint}.*credentials"):
        backend.get_state()
    assert time.monotonic() - start < 2


def test_wrong_password_fails_the_rendezvous_without_retrying(
    auth_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ETCD_USERNAME", "trainer")
    monkeypatch.setenv("ETCD_PASSWORD", "wrong")
    handler = rendezvous.create_handler(_params(auth_server.endpoint, join_timeout=60))
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="credentials"):
        handler.next_rendezvous()
    assert time.monotonic() - start < 5  # not join_timeout: retrying cannot fix a password


def test_outside_the_prefix_is_a_permission_error_not_grpc(
    auth_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ETCD_USERNAME", "trainer")
    monkeypatch.setenv("ETCD_PASSWORD", PASSWORD)
    backend, _ = create_backend(_params(auth_server.endpoint, key_prefix="/other"))
    with pytest.raises(RendezvousConnectionError, match=r"denied.*'trainer'") as info:
        backend.get_state()
    assert type(info.value.__cause__) is EtcdError


def test_unauthenticated_client_is_refused(auth_server: EtcdServer) -> None:
    backend, _ = create_backend(_params(auth_server.endpoint))
    with pytest.raises(RendezvousConnectionError, match=auth_server.endpoint):
        backend.set_state(b"s")


# -- signed state ------------------------------------------------------------------------
# More forgeries (every kind, in every key) are in test_rdzv_signed_values.py.


def _backend(endpoint: str, run_id: str, **conf: object) -> EtcdV3RendezvousBackend:
    # Readers are made after the write they check: a backend's copy of the state
    # follows other writers through a watch, a moment later.
    return create_backend(_params(endpoint, run_id, **conf))[0]


def _unsigned(endpoint: str, run_id: str) -> EtcdV3RendezvousBackend:
    """A backend of an agent run with insecure=true and no secret, or an attacker's."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("ELASTIC_TRAIN_RDZV_SECRET")
        return _backend(endpoint, run_id, insecure="true")


@pytest.fixture
def secret_file(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def run_id() -> str:
    return uuid.uuid4().hex


SECRET = "9f2c" * 16  # 64 hex characters, as `openssl rand -hex 32` writes


def test_signed_round_trip(
    etcd_endpoint: str, secret_file: str, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_TRAIN_RDZV_SECRET", SECRET)
    writer = _backend(etcd_endpoint, run_id, secret_file=secret_file)
    _, token, _ = writer.set_state(b"signed state")
    reader = _backend(etcd_endpoint, run_id)  # the same secret, from the environment
    assert reader.get_state() == (b"signed state", token)
    _, token, written = reader.set_state(b"next", token)
    assert written
    assert _backend(etcd_endpoint, run_id, secret_file=secret_file).get_state() == (b"next", token)


def test_unsigned_writer_is_refused(etcd_endpoint: str, secret_file: str, run_id: str) -> None:
    _unsigned(etcd_endpoint, run_id).set_state(b"unsigned")
    reader = _backend(etcd_endpoint, run_id, secret_file=secret_file)
    with structlog.testing.capture_logs() as logs, pytest.raises(RendezvousStateError):
        reader.get_state()
    (event,) = [e for e in logs if e["event"] == "etcd_value_rejected"]
    assert event["reason"] == "unsigned"
    assert event["key"] == f"/elastic_train/{run_id}/state"


def test_tampered_byte_is_refused(etcd_endpoint: str, secret_file: str, run_id: str) -> None:
    _backend(etcd_endpoint, run_id, secret_file=secret_file).set_state(b"rank assignments")
    client = EtcdClient(EtcdClientConfig(endpoints=(etcd_endpoint,)))
    key = f"/elastic_train/{run_id}/state".encode()
    stored = bytearray(client.get(key)[0].value)
    stored[-3] ^= 0x01
    client.put(key, bytes(stored))
    with pytest.raises(RendezvousStateError, match="HMAC does not match"):
        _backend(etcd_endpoint, run_id, secret_file=secret_file).get_state()


def test_wrong_secret_and_missing_secret_are_refused(
    etcd_endpoint: str, secret_file: str, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _backend(etcd_endpoint, run_id, secret_file=secret_file).set_state(b"s")
    monkeypatch.setenv("ELASTIC_TRAIN_RDZV_SECRET", "another secret of at least 32 bytes")
    with pytest.raises(RendezvousStateError, match=r"HMAC does not match.*another secret"):
        _backend(etcd_endpoint, run_id).get_state()
    monkeypatch.delenv("ELASTIC_TRAIN_RDZV_SECRET")
    with pytest.raises(RendezvousStateError, match="no job secret"):
        _backend(etcd_endpoint, run_id, insecure="true").get_state()


class _Exploit:
    """Unpickling this creates a file: a stand-in for arbitrary code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_forged_state_never_reaches_the_unpickler(
    etcd_endpoint: str, secret_file: str, tmp_path: Path
) -> None:
    """An attacker with write access to the key frames a malicious pickle exactly as an
    unsigned (insecure) writer would; with a job secret the agent refuses it before unpickling."""
    marker = tmp_path / "pwned"
    run_id = uuid.uuid4().hex
    _unsigned(etcd_endpoint, run_id).set_state(pickle.dumps(_Exploit(marker)))
    handler = rendezvous.create_handler(_params(etcd_endpoint, run_id, secret_file=secret_file))
    with pytest.raises(RendezvousStateError):
        handler.next_rendezvous()
    assert not marker.exists()
    # Control: the same bytes without a secret do run code, which is the risk signing removes.
    with pytest.MonkeyPatch.context() as env:
        env.delenv("ELASTIC_TRAIN_RDZV_SECRET")
        unprotected = rendezvous.create_handler(_params(etcd_endpoint, run_id, insecure="true"))
    with pytest.raises(Exception):  # noqa: B017 - whatever torch makes of the object
        unprotected.next_rendezvous()
    assert marker.exists()


def test_heartbeats_are_signed_and_forged_ones_are_left_out(
    etcd_endpoint: str, secret_file: str, run_id: str
) -> None:
    _backend(etcd_endpoint, run_id, secret_file=secret_file).beat("honest_1_0")
    # Written without the secret, as an attacker keeping a dead node "alive" would.
    _unsigned(etcd_endpoint, run_id).beat("forged_2_0")
    reader = _backend(etcd_endpoint, run_id, secret_file=secret_file)
    before = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        seen = reader.heartbeats()
    assert list(seen) == ["honest_1_0"]
    assert before <= seen["honest_1_0"] <= time.monotonic()  # this reader's own clock
    (event,) = [e for e in logs if e["event"] == "etcd_value_rejected"]
    assert event["key"] == f"/elastic_train/{run_id}/heartbeats/forged_2_0"
    assert event["reason"] == "unsigned"
