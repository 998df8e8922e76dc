"""Nothing read from etcd is used unless its MAC checks: forged values in the rendezvous
state, the heartbeat keys and the torch Store, against a real etcd and real handlers."""

from __future__ import annotations

import pickle
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
import torch.distributed as dist
from rendezvous_threads import join_all
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from elastic_train.errors import EtcdValueRejectedError
from elastic_train.etcd.client import EtcdClient, EtcdClientConfig, KeyValue
from elastic_train.etcd.codec import ValueCodec, read_verified
from elastic_train.rendezvous import backend as rendezvous
from elastic_train.rendezvous.liveness import node_name

FORGERIES = ("unsigned", "wrong_secret", "other_run", "other_key")


class _Exploit:
    """Unpickling this creates a file: a stand-in for arbitrary code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


@pytest.fixture(autouse=True)
def _restore_share_store_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.delenv("ELASTIC_TRAIN_RDZV_SECRET", raising=False)


@pytest.fixture
def client(etcd_endpoint: str) -> EtcdClient:
    return EtcdClient(EtcdClientConfig(endpoints=(etcd_endpoint,)))


def _params(endpoint: str, run_id: str, secret_file: Path, **conf: object) -> RendezvousParameters:
    return RendezvousParameters(
        "etcd-v3",
        endpoint,
        run_id,
        int(conf.pop("min_nodes", 1)),  # type: ignore[call-overload]
        int(conf.pop("max_nodes", 1)),  # type: ignore[call-overload]
        secret_file=str(secret_file),
        **conf,
    )


def _forge(kind: str, key: str, payload: bytes, *, secret: bytes, run_id: str) -> bytes:
    """``payload`` framed for ``key`` as an attacker without this job's secret could."""
    if kind == "unsigned":  # the framing of an insecure=true agent
        return ValueCodec(None).encode(key.encode(), payload)
    if kind == "wrong_secret":
        return ValueCodec(secrets.token_hex(32).encode()).encode(key.encode(), payload)
    if kind == "other_run":  # a genuine value of another job that uses the same secret
        return ValueCodec(secret).encode(key.replace(run_id, "another-run").encode(), payload)
    # a genuine value of this job, signed for another of its keys
    return ValueCodec(secret).encode(f"/elastic_train/{run_id}/store/other".encode(), payload)


@pytest.mark.parametrize("kind", FORGERIES)
def test_forged_state_is_refused_before_unpickling(
    kind: str, etcd_endpoint: str, client: EtcdClient, rdzv_secret_file: Path, tmp_path: Path
) -> None:
    run_id, marker = uuid.uuid4().hex, tmp_path / "pwned"
    key = f"/elastic_train/{run_id}/state"
    secret = rdzv_secret_file.read_bytes().strip()
    exploit = pickle.dumps(_Exploit(marker))
    client.put(key.encode(), _forge(kind, key, exploit, secret=secret, run_id=run_id))
    handler = rendezvous.create_handler(_params(etcd_endpoint, run_id, rdzv_secret_file))
    with structlog.testing.capture_logs() as logs, pytest.raises(RendezvousStateError, match=key):
        handler.next_rendezvous()
    assert not marker.exists(), "the forged pickle ran"
    rejected = [e for e in logs if e["event"] == "etcd_value_rejected"]
    assert rejected and {e["key"] for e in rejected} == {key}
    assert rejected[0]["reason"] == ("unsigned" if kind == "unsigned" else "bad_signature")


@pytest.mark.parametrize("kind", FORGERIES)
def test_forged_heartbeat_is_no_sign_of_life(
    kind: str, etcd_endpoint: str, client: EtcdClient, rdzv_secret_file: Path
) -> None:
    run_id = uuid.uuid4().hex
    backend, _ = rendezvous.create_backend(_params(etcd_endpoint, run_id, rdzv_secret_file))
    backend.beat("honest_1_0")
    key = f"/elastic_train/{run_id}/heartbeats/ghost_2_0"
    secret = rdzv_secret_file.read_bytes().strip()
    client.put(
        key.encode(), _forge(kind, key, b"99999999999999999999", secret=secret, run_id=run_id)
    )
    with structlog.testing.capture_logs() as logs:
        assert list(backend.heartbeats()) == ["honest_1_0"]
    assert [e["key"] for e in logs if e["event"] == "etcd_value_rejected"] == [key]


def test_replayed_older_heartbeat_is_no_sign_of_life(
    etcd_endpoint: str, client: EtcdClient, rdzv_secret_file: Path
) -> None:
    """A genuine, correctly signed heartbeat written back later (a replay of the same key)
    does not make a stopped node look alive: only a larger counter is a sign of life."""
    run_id = uuid.uuid4().hex
    params = _params(etcd_endpoint, run_id, rdzv_secret_file)
    node, _ = rendezvous.create_backend(params)
    reader, _ = rendezvous.create_backend(params)
    key = f"/elastic_train/{run_id}/heartbeats/node_1_0".encode()
    node.beat("node_1_0")
    old = client.get(key)[0]
    assert old is not None
    node.beat("node_1_0")
    first_seen = reader.heartbeats()["node_1_0"]
    client.put(key, old.value)  # the attacker replays the older value: a new mod_revision
    with structlog.testing.capture_logs() as logs:
        assert reader.heartbeats()["node_1_0"] == first_seen
    assert [e["key"] for e in logs if e["event"] == "rendezvous_heartbeat_replayed"] == [
        key.decode()
    ]


@pytest.mark.parametrize("kind", FORGERIES)
def test_forged_store_value_is_refused(
    kind: str, etcd_endpoint: str, client: EtcdClient, rdzv_secret_file: Path
) -> None:
    """The Store holds what the agents hand their workers (MASTER_ADDR, rank assignments)."""
    run_id = uuid.uuid4().hex
    _, store = rendezvous.create_backend(_params(etcd_endpoint, run_id, rdzv_secret_file))
    key = f"/elastic_train/{run_id}/store/MASTER_ADDR"
    secret = rdzv_secret_file.read_bytes().strip()
    client.put(key.encode(), _forge(kind, key, b"attacker.example", secret=secret, run_id=run_id))
    with pytest.raises(EtcdValueRejectedError, match=key):
        store.get("MASTER_ADDR")
    with pytest.raises(EtcdValueRejectedError, match=key):
        store.compare_set("MASTER_ADDR", "", "x")
    with pytest.raises(EtcdValueRejectedError, match=key):
        store.add("MASTER_ADDR", 1)


def test_forged_store_value_is_refused_through_torchs_prefix_store(
    etcd_endpoint: str, client: EtcdClient, rdzv_secret_file: Path
) -> None:
    run_id = uuid.uuid4().hex
    _, store = rendezvous.create_backend(_params(etcd_endpoint, run_id, rdzv_secret_file))
    prefixed = dist.PrefixStore("torch.rendezvous.run.0", store)
    prefixed.set("MASTER_PORT", "29500")
    key = f"/elastic_train/{run_id}/store/torch.rendezvous.run.0/MASTER_ADDR"
    client.put(key.encode(), ValueCodec(None).encode(key.encode(), b"attacker.example"))
    assert prefixed.get("MASTER_PORT") == b"29500"
    with pytest.raises(EtcdValueRejectedError, match="MASTER_ADDR"):
        prefixed.get("MASTER_ADDR")


def test_a_consistently_refused_value_is_read_once_more_then_refused(
    etcd_endpoint: str, client: EtcdClient, rdzv_secret_file: Path
) -> None:
    """The bounded re-read cannot hide a forgery: the same bytes are refused at once."""
    run_id = uuid.uuid4().hex
    key = f"/elastic_train/{run_id}/state"
    client.put(key.encode(), ValueCodec(None).encode(key.encode(), b"forged"))
    backend, _ = rendezvous.create_backend(_params(etcd_endpoint, run_id, rdzv_secret_file))
    with structlog.testing.capture_logs() as logs, pytest.raises(RendezvousStateError):
        backend.get_state()
    events = [e["event"] for e in logs]
    assert events.count("etcd_value_rejected") == 1
    assert "etcd_value_reread" not in events


def _scripted(values: list[KeyValue | None]) -> tuple[Callable[[], KeyValue | None], list[int]]:
    calls: list[int] = []

    def reread() -> KeyValue | None:
        calls.append(1)
        return values[len(calls)]

    return reread, calls


def test_read_verified_retries_only_a_changed_value() -> None:
    """Unit test of the pure retry rule: a refused value is re-read; a different value is
    checked afresh (at most twice), the very same value is refused at once."""
    codec = ValueCodec(b"k" * 32)
    key = b"/elastic_train/run/state"
    bad = [KeyValue(key, ValueCodec(None).encode(key, b"x"), rev) for rev in (5, 6, 7)]
    good = KeyValue(key, codec.encode(key, b"state"), 8)

    reread, calls = _scripted([bad[0], good])  # a stale copy, then the current value
    assert read_verified(codec, key, bad[0], reread) == (b"state", good)
    assert len(calls) == 1

    reread, calls = _scripted([bad[0], bad[0]])  # the same stored value: a forgery
    with pytest.raises(EtcdValueRejectedError):
        read_verified(codec, key, bad[0], reread)
    assert len(calls) == 1

    reread, calls = _scripted([bad[0], bad[1], bad[2], good])  # bounded: 3 checks in all
    with pytest.raises(EtcdValueRejectedError):
        read_verified(codec, key, bad[0], reread)
    assert len(calls) == 2

    reread, calls = _scripted([bad[0], None])  # deleted meanwhile
    assert read_verified(codec, key, bad[0], reread) is None


def test_a_node_with_the_wrong_secret_is_not_admitted(
    etcd_endpoint: str, client: EtcdClient, rdzv_secret_file: Path, tmp_path: Path
) -> None:
    run_id = uuid.uuid4().hex
    conf = {"min_nodes": 2, "max_nodes": 3, "last_call_timeout": 1}
    first, second = (
        rendezvous.create_handler(_params(etcd_endpoint, run_id, rdzv_secret_file, **conf))
        for _ in range(2)
    )
    wrong_file = tmp_path / "wrong-secret"
    wrong_file.write_text(secrets.token_hex(32))
    wrong = rendezvous.create_handler(_params(etcd_endpoint, run_id, wrong_file, **conf))
    first_result: list[tuple[int, int]] = []
    joining = threading.Thread(target=lambda: first_result.extend(join_all([first], within=30)))
    joining.start()  # alone below min_nodes=2: it waits in an open round
    key = f"/elastic_train/{run_id}/state"
    deadline = time.monotonic() + 10
    while client.get(key.encode())[0] is None:
        assert time.monotonic() < deadline, "the first node never wrote the state"
        time.sleep(0.05)
    before = client.get(key.encode())[0]
    started = time.monotonic()
    with pytest.raises(RendezvousStateError, match=f"{key}.*HMAC does not match"):
        wrong.next_rendezvous()
    assert time.monotonic() - started < 5, "a refused state is not retried until join_timeout"
    assert client.get(key.encode())[0] == before, "the refused node wrote the state"
    assert join_all([second], within=30) in ([(0, 2)], [(1, 2)])
    joining.join(30)
    assert first_result in ([(0, 2)], [(1, 2)])
    state = first._state_holder.state  # type: ignore[attr-defined]
    names = {node_name(n) for n in state.participants}
    assert node_name(wrong._this_node) not in names and len(names) == 2  # type: ignore[attr-defined]
    for handler in (first, second):
        handler.shutdown()
