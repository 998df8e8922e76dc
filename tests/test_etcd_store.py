"""EtcdV3Store semantics against a real etcd, directly and through c10d's PrefixStore,
every value signed with a job secret."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_train.etcd.client import EtcdClient, EtcdClientConfig
from elastic_train.etcd.codec import ValueCodec
from elastic_train.etcd.server import EtcdServer
from elastic_train.etcd.store import EtcdV3Store


@pytest.fixture
def store(etcd_server: EtcdServer) -> Iterator[EtcdV3Store]:
    client = EtcdClient(EtcdClientConfig(endpoints=(etcd_server.endpoint,)))
    yield EtcdV3Store(
        client,
        f"/test/store/{uuid.uuid4().hex}",
        codec=ValueCodec(b"s" * 32),
        timeout=timedelta(seconds=5),
    )
    client.close()


def test_set_get_roundtrip_str_and_bytes(store: EtcdV3Store) -> None:
    store.set("a", "text")
    store.set("b", b"\x00\xffbin")
    assert store.get("a") == b"text"
    assert store.get("b") == b"\x00\xffbin"


def test_get_blocks_until_another_thread_sets(store: EtcdV3Store) -> None:
    setter = threading.Timer(0.3, store.set, args=("late", b"v"))
    start = time.monotonic()
    setter.start()
    assert store.get("late") == b"v"
    waited = time.monotonic() - start
    setter.join()
    assert 0.25 <= waited < 2.0


def test_get_times_out_on_missing_key(store: EtcdV3Store) -> None:
    store.set_timeout(timedelta(seconds=0.3))
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="'missing'"):
        store.get("missing")
    assert 0.3 <= time.monotonic() - start < 1.5


def test_add_from_eight_threads_loses_no_increment(store: EtcdV3Store) -> None:
    def work(_: int) -> list[int]:
        return [store.add("counter", 1) for _ in range(10)]

    with ThreadPoolExecutor(8) as pool:
        results = [v for chunk in pool.map(work, range(8)) for v in chunk]
    assert sorted(results) == list(range(1, 81))  # every add saw a distinct value
    assert store.get("counter") == b"80"
    assert store.add("counter", -5) == 75


def test_compare_set_like_tcpstore(store: EtcdV3Store) -> None:
    assert store.compare_set("k", "", "first") == b"first"  # absent + empty expected: set
    assert store.compare_set("k", "wrong", "x") == b"first"  # mismatch: current value
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.get("k") == b"second"
    assert store.compare_set("absent", "e", "d") == b"e"  # absent + non-empty: expected
    assert not store.check(["absent"])


def test_check_wait_delete_num_keys(store: EtcdV3Store) -> None:
    assert store.num_keys() == 0
    store.set("x", "1")
    assert store.check(["x"])
    assert not store.check(["x", "y"])
    threading.Timer(0.2, store.set, args=("y", "2")).start()
    store.wait(["x", "y"])
    with pytest.raises(dist.DistStoreError, match="'z'"):
        store.wait(["x", "z"], timedelta(seconds=0.2))
    assert store.num_keys() == 2
    assert store.delete_key("x") is True
    assert store.delete_key("x") is False
    assert store.num_keys() == 1


def test_through_prefix_store_as_torchrun_uses_it(store: EtcdV3Store) -> None:
    prefixed = dist.PrefixStore("torch.rendezvous.run.0", store)
    prefixed.multi_set(["r/0", "r/1"], [b"a", b"b"])
    assert prefixed.multi_get(["r/0", "r/1"]) == [b"a", b"b"]
    assert prefixed.add("n", 2) == 2
    assert prefixed.delete_key("n")
    prefixed.wait(["r/0"])
    assert store.get("torch.rendezvous.run.0/r/1") == b"b"
    assert prefixed.num_keys() == 2
