from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from elastic_train.errors import EtcdServerError
from elastic_train.etcd.server import EtcdCluster, EtcdServer


def test_session_server_is_healthy_and_v2_is_off(etcd_server: EtcdServer) -> None:
    with urllib.request.urlopen(f"{etcd_server.client_url}/health", timeout=5) as resp:
        assert b'"health":"true"' in resp.read()
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{etcd_server.client_url}/v2/keys", timeout=5)
    assert info.value.code == 404


def test_bad_flag_fails_fast_with_log(tmp_path: Path) -> None:
    server = EtcdServer(data_dir=tmp_path / "d", extra_args=["--no-such-flag"])
    with pytest.raises(EtcdServerError, match="exited"):
        server.start(timeout=10)


def test_three_member_cluster_elects_a_new_leader(tmp_path: Path) -> None:
    cluster = EtcdCluster(tmp_path, size=3).start()
    try:
        old = cluster.leader()
        old.kill()
        new = cluster.leader()
        assert new is not old
    finally:
        cluster.stop()
