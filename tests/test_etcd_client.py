"""EtcdClient against a real etcd: bounded dialing, failover, transactions, watches, leases."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from elastic_train.errors import EtcdError, EtcdUnavailableError
from elastic_train.etcd.client import EtcdClient, EtcdClientConfig, fails_over, parse_endpoint
from elastic_train.etcd.server import EtcdCluster, EtcdServer, free_port
from elastic_train.etcd.sync import LeaseKeeper, WatchedKey


@pytest.fixture
def client(etcd_server: EtcdServer) -> Iterator[EtcdClient]:
    c = EtcdClient(EtcdClientConfig(endpoints=(etcd_server.endpoint,)))
    yield c
    c.close()


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A port that accepts TCP connections and never speaks (a hung or firewalled host)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(0)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def _key(request: pytest.FixtureRequest) -> bytes:
    return f"/test/client/{request.node.name}/{time.monotonic_ns()}".encode()


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("h:1", ("h", 1)),
        ("h", ("h", 2379)),
        ("http://h:2", ("h", 2)),
        ("[::1]:3", ("::1", 3)),
    ],
)
def test_parse_endpoint(endpoint: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(endpoint, protocol="http") == expected


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"protocol": "grpc"}, "protocol='grpc'.*http, https"),
        ({"cert": "/x"}, "protocol=https"),
        ({"protocol": "https", "cert": "/x"}, "cert and key"),
        ({"protocol": "https", "cacert": "/nonexistent/ca.pem"}, "cacert='/nonexistent/ca.pem'"),
        ({"username": "u"}, "username and password"),
        ({"dial_timeout": 0}, "dial_timeout=0"),
        ({"endpoints": ("h:notaport",)}, "h:notaport"),
        ({"endpoints": ("https://h:1",)}, "https://.*protocol=http"),
        ({"endpoints": ()}, "endpoint is empty"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        EtcdClientConfig(**{"endpoints": ("127.0.0.1:2379",), **kwargs})


def test_password_not_in_repr() -> None:
    config = EtcdClientConfig(endpoints=("h:1",), username="u", password="hunter2")
    assert "hunter2" not in repr(config)


def test_refused_endpoint_fails_within_dial_timeout_naming_it() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    client = EtcdClient(EtcdClientConfig(endpoints=(endpoint,), dial_timeout=1))
    start = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=f"http://{endpoint}.*refused"):
        client.get(b"/k")
    assert time.monotonic() - start < 1.8


def test_silent_endpoint_fails_within_dial_timeout_naming_it(silent_endpoint: str) -> None:
    client = EtcdClient(EtcdClientConfig(endpoints=(silent_endpoint,), dial_timeout=1))
    start = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=silent_endpoint):
        client.get(b"/k")
    assert time.monotonic() - start < 1.8


def test_fails_over_past_dead_and_silent_members(
    etcd_server: EtcdServer, silent_endpoint: str
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    endpoints = (silent_endpoint, dead, etcd_server.endpoint)
    client = EtcdClient(EtcdClientConfig(endpoints=endpoints, dial_timeout=1))
    start = time.monotonic()
    client.put(b"/test/failover", b"v")
    assert time.monotonic() - start < 2.0  # one dial_timeout for the silent member
    start = time.monotonic()
    assert client.get(b"/test/failover")[0].value == b"v"
    assert time.monotonic() - start < 0.5  # sticks to the live member


def test_hung_member_costs_one_read_timeout_then_fails_over(tmp_path: Path) -> None:
    cluster = EtcdCluster(tmp_path, size=3).start()
    try:
        hung = cluster.members[0]
        config = EtcdClientConfig(
            endpoints=tuple(m.endpoint for m in cluster.members), read_timeout=1
        )
        client = EtcdClient(config)
        client.put(b"/test/hung", b"1")  # connected to the first member
        os.kill(hung.process.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            client.put(b"/test/hung", b"2")
            assert time.monotonic() - start < 3.0
            assert client.get(b"/test/hung")[0].value == b"2"
        finally:
            os.kill(hung.process.pid, signal.SIGCONT)
    finally:
        cluster.stop()


def test_put_if_revision(client: EtcdClient, request: pytest.FixtureRequest) -> None:
    key = _key(request)
    assert client.put_if_revision(key, b"a", mod_revision=0)[0]
    written, current, _ = client.put_if_revision(key, b"b", mod_revision=0)
    assert not written and current.value == b"a"
    written, _, revision = client.put_if_revision(key, b"b", mod_revision=current.mod_revision)
    assert written
    assert client.get(key)[0].mod_revision == revision


def test_put_if_value(client: EtcdClient, request: pytest.FixtureRequest) -> None:
    key = _key(request)
    assert client.put_if_value(key, b"1", expected=None)[0]
    written, current, _ = client.put_if_value(key, b"2", expected=b"0")
    assert not written and current.value == b"1"
    assert client.put_if_value(key, b"2", expected=b"1")[0]
    assert client.get(key)[0].value == b"2"


def test_get_prefix_from_a_start_key(client: EtcdClient, request: pytest.FixtureRequest) -> None:
    base = _key(request)
    prefix = base + b"/gen/"
    for number in (1, 2, 9, 10):
        client.put(prefix + b"%06d" % number, b"x")
    client.put(base + b"/gen0", b"beside the prefix")
    every, _ = client.get_prefix(prefix)
    later, _ = client.get_prefix(prefix, start=prefix + b"000002")
    assert [kv.key[len(prefix) :] for kv in every] == [b"000001", b"000002", b"000009", b"000010"]
    assert [kv.key[len(prefix) :] for kv in later] == [b"000002", b"000009", b"000010"]
    assert client.get_prefix(prefix, start=prefix + b"000011")[0] == []


def test_watch_once_wakes_on_write_and_times_out(
    client: EtcdClient, request: pytest.FixtureRequest
) -> None:
    key = _key(request)
    _, revision = client.get(key)
    start = time.monotonic()
    assert client.watch_once(key, prefix=False, start_revision=revision + 1, timeout=0.3) is False
    assert time.monotonic() - start >= 0.3
    writer = threading.Timer(0.2, client.put, args=(key, b"v"))
    writer.start()
    assert client.watch_once(key, prefix=False, start_revision=revision + 1, timeout=10) is True
    writer.join()


def test_lease_keeper_key_expires_after_ttl(
    client: EtcdClient, request: pytest.FixtureRequest
) -> None:
    key = _key(request)
    keeper = LeaseKeeper(client, ttl=2)
    keeper.run(lambda lease: client.put(key, b"v", lease=lease))
    assert client.get(key)[0] is not None
    deadline = time.monotonic() + 8
    while client.get(key)[0] is not None:
        assert time.monotonic() < deadline, "leased key outlived its TTL"
        time.sleep(0.2)
    # A write after expiry takes a fresh lease instead of failing.
    keeper.run(lambda lease: client.put(key, b"again", lease=lease))
    assert client.get(key)[0].value == b"again"


def test_non_connection_errors_are_translated(client: EtcdClient) -> None:
    with pytest.raises(EtcdError, match=r"etcd at http://.*INVALID_ARGUMENT"):
        client.put(b"", b"v")  # etcd refuses an empty key


class _CountingClient(EtcdClient):
    """The real client, counting reads of the store."""

    reads = 0

    def get(self, key: bytes) -> tuple:
        self.reads += 1
        return super().get(key)


def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _served_locally(counting: _CountingClient, watched: WatchedKey) -> bool:
    before = counting.reads
    watched.read()
    return counting.reads == before


def test_watched_key_follows_writers_without_polling(
    etcd_server: EtcdServer, request: pytest.FixtureRequest
) -> None:
    key = _key(request)
    counting = _CountingClient(EtcdClientConfig(endpoints=(etcd_server.endpoint,)))
    watched = WatchedKey(counting, key)
    try:
        writer = EtcdClient(EtcdClientConfig(endpoints=(etcd_server.endpoint,)))
        writer.put(key, b"one")
        _until(lambda: (v := watched.read()) is not None and v.value == b"one")
        _until(lambda: _served_locally(counting, watched))  # the watch thread is up
        reads = counting.reads
        for _ in range(50):  # torch's handler polls like this, about once a second
            assert watched.read().value == b"one"
        assert counting.reads == reads  # served by the watched copy
        writer.delete(key)
        _until(lambda: watched.read() is None)
    finally:
        watched.close()


def test_watched_key_reads_etcd_when_the_watch_breaks(tmp_path: Path) -> None:
    server = EtcdServer(data_dir=tmp_path / "data", name="watched").start()
    client = EtcdClient(EtcdClientConfig(endpoints=(server.endpoint,), dial_timeout=1))
    watched = WatchedKey(client, b"/k")
    try:
        client.put(b"/k", b"v")
        _until(lambda: (v := watched.read()) is not None and v.value == b"v")
        server.stop()
        # Not the stale copy: once the stream is gone, reads go to etcd and fail.
        _until(lambda: _raises_unavailable(watched))
    finally:
        watched.close()
        server.stop()


def _raises_unavailable(watched: WatchedKey) -> bool:
    try:
        watched.read()
    except EtcdUnavailableError:
        return True
    return False


class _Refusal(grpc.RpcError):
    """An RpcError as grpc raises one (code and details), for the pure classifier below."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "details", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, "etcdserver: leader changed", True),
        (grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader", True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", True),
        # etcd's ErrGRPCNotLeader: during an election a lease call can get it
        (grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: not leader", True),
        (grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: some other precondition", False),
        (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied", False),
        (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found", False),
    ],
)
def test_refusals_that_another_member_may_serve_fail_over(
    code: grpc.StatusCode, details: str, expected: bool
) -> None:
    assert fails_over(_Refusal(code, details)) is expected
