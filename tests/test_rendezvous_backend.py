"""EtcdV3RendezvousBackend contract, rdzv-conf parsing, the handler and the torchrun takeover,
all against real etcd servers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from rendezvous_threads import join_all
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic_train import torchrun_plugin
from elastic_train.etcd.client import EtcdClient, EtcdClientConfig
from elastic_train.etcd.server import EtcdCluster, EtcdServer, free_port
from elastic_train.rendezvous import backend as rendezvous
from elastic_train.rendezvous.backend import create_backend
from elastic_train.rendezvous.config import parse_config
from elastic_train.rendezvous.keys import EtcdV3RendezvousBackend


def _params(endpoint: str, backend: str = "etcd-v3", **conf: object) -> RendezvousParameters:
    return RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=f"run-{uuid.uuid4().hex[:8]}",
        min_nodes=int(conf.pop("min_nodes", 1)),  # type: ignore[call-overload]
        max_nodes=int(conf.pop("max_nodes", 1)),  # type: ignore[call-overload]
        **conf,
    )


def _same_run(p: RendezvousParameters) -> RendezvousParameters:
    """Another node's parameters for the same run."""
    return RendezvousParameters(
        p.backend, p.endpoint, p.run_id, p.min_nodes, p.max_nodes, p.local_addr, **p.config
    )


@pytest.fixture(autouse=True)
def _restore_share_store_env(monkeypatch: pytest.MonkeyPatch, rdzv_secret: str) -> None:
    # create_handler sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE; keep it out of other tests.
    # Every backend here signs with the job secret (rdzv_secret, in the environment).
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)


@pytest.fixture
def backend(etcd_endpoint: str) -> EtcdV3RendezvousBackend:
    return create_backend(_params(etcd_endpoint))[0]


# -- backend contract -------------------------------------------------------------------------


def test_get_state_on_empty_store_is_none(backend: EtcdV3RendezvousBackend) -> None:
    assert backend.get_state() is None


def test_set_state_on_absent_key_creates_it(backend: EtcdV3RendezvousBackend) -> None:
    state, token, written = backend.set_state(b"s1")
    assert (state, written) == (b"s1", True)
    assert backend.get_state() == (b"s1", token)


def test_set_state_with_current_token_replaces(backend: EtcdV3RendezvousBackend) -> None:
    _, token, _ = backend.set_state(b"s1")
    state, new_token, written = backend.set_state(b"s2", token)
    assert (state, written) == (b"s2", True)
    assert new_token != token
    assert backend.get_state() == (b"s2", new_token)


def test_stale_token_returns_current_state(backend: EtcdV3RendezvousBackend) -> None:
    _, stale, _ = backend.set_state(b"s1")
    _, current, _ = backend.set_state(b"s2", stale)
    assert backend.set_state(b"s3", stale) == (b"s2", current, False)
    assert backend.get_state() == (b"s2", current)


def test_none_token_on_existing_key_returns_current(backend: EtcdV3RendezvousBackend) -> None:
    _, token, _ = backend.set_state(b"s1")
    assert backend.set_state(b"other", None) == (b"s1", token, False)


@pytest.mark.parametrize("token", ["abc", -3, 0, 1.5, True, "", object()])
def test_invalid_token_returns_current_state(
    backend: EtcdV3RendezvousBackend, token: object
) -> None:
    _, current, _ = backend.set_state(b"s1")
    assert backend.set_state(b"evil", token) == (b"s1", current, False)


def test_corrupt_stored_bytes_raise_state_error(etcd_endpoint: str) -> None:
    # Each read uses a backend made after the write: a backend's copy of the state
    # follows other writers through a watch, a moment later.
    params = _params(etcd_endpoint)
    key = f"/elastic_train/{params.run_id}/state".encode()
    client = EtcdClient(EtcdClientConfig(endpoints=(etcd_endpoint,)))
    client.put(key, b"garbage")
    with pytest.raises(RendezvousStateError, match=f"{params.run_id}/state"):
        create_backend(params)[0].get_state()
    client.delete(key)
    create_backend(params)[0].set_state(b"good")
    client.put(key, client.get(key)[0].value[:-1] + b"X")  # a framed value, last byte flipped
    with pytest.raises(RendezvousStateError, match="HMAC does not match"):
        create_backend(params)[0].get_state()


def test_unreachable_endpoint_is_connection_error_within_dial_timeout() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    backend, _ = create_backend(_params(endpoint, dial_timeout=1))
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"unreachable.*{endpoint}"):
        backend.set_state(b"s")
    assert time.monotonic() - start < 1.8


def test_backend_name_is_the_requested_one(etcd_endpoint: str) -> None:
    assert create_backend(_params(etcd_endpoint, backend="etcd"))[0].name == "etcd"
    assert create_backend(_params(etcd_endpoint))[0].name == "etcd-v3"


def test_state_key_lives_under_a_lease_renewed_while_the_backend_is_open(
    etcd_endpoint: str,
) -> None:
    params = _params(etcd_endpoint, ttl=2)
    backend, _ = create_backend(params)
    backend.set_state(b"s")
    written = time.monotonic()
    reader, _ = create_backend(_same_run(params))
    # No write for twice the ttl: agents write only during a rendezvous.
    while time.monotonic() - written < 4:
        assert reader.get_state() is not None, "the state key expired while its writer ran"
        time.sleep(0.2)
    backend.close()  # the writer goes away: nobody renews its lease
    closed = time.monotonic()
    while reader.get_state() is not None:
        assert time.monotonic() - closed < 8, "state key outlived its ttl"
        time.sleep(0.2)


# -- rdzv-conf --------------------------------------------------------------------------------


def test_defaults_favour_fast_recovery() -> None:
    handler = parse_config(_params("127.0.0.1:2379")).handler
    # A dead node is pruned after interval x attempts; torch's defaults give 15 s and 30 s.
    assert handler.keep_alive_interval * handler.keep_alive_max_attempt <= 3
    assert handler.last_call_timeout <= 2


@pytest.mark.parametrize(
    ("conf", "names"),
    [
        ({"last_call_timout": "1"}, r"last_call_timout.*accepted keys: \[.*last_call_timeout"),
        ({"ttl": "soon"}, "ttl='soon'.*positive integer"),
        ({"keep_alive_interval": "0"}, "keep_alive_interval='0'"),
        ({"dial_timeout": "-1"}, "dial_timeout='-1'.*positive number of seconds"),
        ({"protocol": "ftp"}, "protocol='ftp'.*http, https"),
        ({"key_prefix": "relative"}, "key_prefix='relative'"),
        ({"secret_file": "/nonexistent/secret"}, "secret_file='/nonexistent/secret'"),
    ],
)
def test_bad_rdzv_conf_names_key_and_accepted_values(conf: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        parse_config(_params("127.0.0.1:2379", **conf))


def test_empty_endpoint_is_refused() -> None:
    with pytest.raises(ValueError, match="endpoint is empty"):
        parse_config(_params(""))


def test_credentials_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETCD_USERNAME", "alice")
    monkeypatch.setenv("ETCD_PASSWORD", "s3cret")
    client = parse_config(_params("h:1")).client
    assert (client.username, client.password) == ("alice", "s3cret")
    assert parse_config(_params("h:1", username="bob", password="pw")).client.username == "bob"


# -- the handler --------------------------------------------------------------------------------


def _rendezvous_all(params: list[RendezvousParameters]) -> list[tuple[int, int]]:
    """Run one handler per params in threads; return each one's (rank, world_size)."""
    handlers = [rendezvous.create_handler(p) for p in params]
    try:
        return join_all(handlers, within=60)
    finally:
        for handler in handlers:
            handler.shutdown()  # stops the heartbeat thread


def test_two_nodes_rendezvous_through_torch_handler(etcd_endpoint: str) -> None:
    first = _params(etcd_endpoint, min_nodes=2, max_nodes=2)
    second = _same_run(first)
    ranks = _rendezvous_all([first, second])
    assert sorted(ranks) == [(0, 2), (1, 2)]


def test_outage_rendezvous_retries_until_join_timeout() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    handler = rendezvous.create_handler(_params(endpoint, join_timeout=2, dial_timeout=1))
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"join_timeout=2s.*{endpoint}"):
        handler.next_rendezvous()
    assert 2 <= time.monotonic() - start < 5


def test_rendezvous_rides_out_an_etcd_that_comes_late(tmp_path: Path) -> None:
    server = EtcdServer(data_dir=tmp_path / "data", name="late")
    handler = rendezvous.create_handler(_params(server.endpoint, join_timeout=30, dial_timeout=1))
    starter = threading.Timer(1.5, server.start)
    starter.start()
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        handler.shutdown()
    finally:
        starter.join()
        server.stop()


def test_outage_while_training_does_not_stop_the_agent(tmp_path: Path) -> None:
    server = EtcdServer(data_dir=tmp_path / "data", name="outage").start()
    try:
        handler = rendezvous.create_handler(_params(server.endpoint, dial_timeout=1))
        handler.next_rendezvous()
        server.stop()
        assert handler.num_nodes_waiting() == 0  # logged, not raised
        server.start()
        assert handler.num_nodes_waiting() == 0
        handler.shutdown()
    finally:
        server.stop()


def test_leader_down_during_rendezvous_of_three_member_cluster(tmp_path: Path) -> None:
    cluster = EtcdCluster(tmp_path, size=3).start()
    try:
        leader = cluster.leader()
        # The leader first, so that every client starts on the member that dies.
        ordered = [leader] + [m for m in cluster.members if m is not leader]
        endpoint = ",".join(m.endpoint for m in ordered)
        first = _params(endpoint, min_nodes=2, max_nodes=2)
        handlers = [rendezvous.create_handler(first), rendezvous.create_handler(_same_run(first))]
        results: list[tuple[int, int] | BaseException | None] = [None, None]

        def join(i: int) -> None:
            try:
                info = handlers[i].next_rendezvous()
                results[i] = (info.rank, info.world_size)
            except BaseException as exc:  # reported below
                results[i] = exc

        # Both handlers shut down only once both are done: a handler's shutdown
        # closes the rendezvous, and the early node, failing over from the dead
        # leader, could still be on its way to the completed round (seen in CI).
        threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in (0, 1)]
        try:
            threads[0].start()
            time.sleep(0.5)  # let the first node join the round before the leader dies
            leader.kill()
            threads[1].start()
            deadline = time.monotonic() + 60
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        finally:
            for handler in handlers:
                handler.shutdown()
        errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
        assert not errors, errors
        assert sorted(results) == [(0, 2), (1, 2)], results  # type: ignore[type-var]
    finally:
        cluster.stop()


# -- registration with torchrun -----------------------------------------------------------------


def test_etcd_takeover_is_live(etcd_endpoint: str) -> None:
    """Fails loudly if a torch upgrade breaks the entry-point takeover of ``etcd``."""
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    assert rendezvous_handler_registry._registry["etcd"] is torchrun_plugin.create_handler
    assert rendezvous_handler_registry._registry["etcd-v3"] is torchrun_plugin.create_handler
    # Through torch's registry: our plugin, node agent included (its endpoint off).
    params = _params(etcd_endpoint, backend="etcd", metrics_port="off")
    handler = get_rendezvous_handler(params)
    assert handler.get_backend() == "etcd"
    handler.next_rendezvous()
    handler.shutdown()
    client = EtcdClient(EtcdClientConfig(endpoints=(etcd_endpoint,)))
    stored, _ = client.get(f"/elastic_train/{params.run_id}/state".encode())
    assert stored is not None and stored.value.startswith(b"ETv3")


def test_etcd_takeover_opt_out() -> None:
    code = (
        "from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry as r;"
        "print(r._registry['etcd'].__module__, r._registry['etcd-v3'].__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "ELASTIC_TRAIN_NO_ETCD_TAKEOVER": "1"},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    assert out == [
        "torch.distributed.elastic.rendezvous.registry",
        "elastic_train.torchrun_plugin",
    ]
