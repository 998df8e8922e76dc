"""A job secret on the local launch path: ``elastic-train local`` and every ``LocalCluster``.

The secret is made per run (64 hex characters in a 0600 file of the run dir),
named by path in our backend's ``--rdzv-conf`` only, and the agents sign
their rendezvous values with it. The competitors the benchmarks run get none.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import psutil
import pytest
from test_local import WORKER, live_workers, wait_for

from elastic_train.errors import ConfigError, EtcdError
from elastic_train.etcd.client import EtcdClient, EtcdClientConfig
from elastic_train.local import proctree
from elastic_train.local.agent_forks import ForkedAgent
from elastic_train.local.cluster import ClusterSpec, LocalCluster
from elastic_train.local.embedded_etcd import start_embedded_etcd
from elastic_train.local.rdzv_secret import SECRET_ENV, secret_source


def _spec(backend: str = "etcd", conf: str = "", **extra: object) -> ClusterSpec:
    return ClusterSpec(
        nodes=2, rdzv_backend=backend, rdzv_conf=conf, script=WORKER,
        script_args=("{run_dir}",), trainer_args=False, metrics_port=None, timeout_s=120,
        **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def _rdzv_conf(cluster: LocalCluster) -> str:
    confs = [a.split("=", 1)[1] for a in cluster.command() if a.startswith("--rdzv-conf=")]
    return confs[0] if confs else ""


@pytest.mark.parametrize("backend", ["etcd", "etcd-v3"])
def test_our_backends_get_the_secret_file_of_the_run(backend: str, tmp_path: Path) -> None:
    cluster = LocalCluster(_spec(backend, "last_call_timeout=1"), run_dir=tmp_path)
    assert cluster.secret_file == tmp_path / "rdzv-secret"
    assert _rdzv_conf(cluster) == f"last_call_timeout=1,secret_file={tmp_path / 'rdzv-secret'}"


@pytest.mark.parametrize(
    ("backend", "conf"),
    [
        # torch's backends do not know the key: c10d would refuse it, etcd-v2 ignore it.
        ("c10d", "is_host=0"),
        ("etcd-v2", "last_call_timeout=1"),
        # The spec gives its own secret, or asks to run unsigned on purpose.
        ("etcd", "secret_file=/run/secrets/rdzv"),
        ("etcd-v3", "insecure=true"),
    ],
)
def test_no_secret_is_made_where_it_is_not_ours_to_add(
    backend: str, conf: str, tmp_path: Path
) -> None:
    cluster = LocalCluster(_spec(backend, conf), run_dir=tmp_path)
    assert cluster.secret_file is None
    assert _rdzv_conf(cluster) == conf


def test_a_secret_in_the_environment_is_the_spec_s_secret(tmp_path: Path) -> None:
    env = ((SECRET_ENV, "x" * 64),)
    cluster = LocalCluster(_spec("etcd", env=env), run_dir=tmp_path)
    assert cluster.secret_file is None and _rdzv_conf(cluster) == ""
    assert secret_source("etcd", "", {SECRET_ENV: "  "}) is None  # blank is no secret
    with pytest.raises(ConfigError, match="'oops' is not key=value"):
        secret_source("etcd", "oops", {})


def _state_value(endpoint: str, run_id: str, login: dict[str, str]) -> bytes | None:
    """The run's rendezvous state, read as ``login`` (no login: anonymously)."""
    user, password = login.get("ETCD_USERNAME"), login.get("ETCD_PASSWORD")
    client = EtcdClient(EtcdClientConfig(endpoints=(endpoint,), username=user, password=password))
    try:
        kv, _ = client.get(f"/elastic_train/{run_id}/state".encode())
    finally:
        client.close()
    return kv.value if kv else None


@pytest.mark.slow
def test_a_local_run_signs_its_rendezvous_with_a_private_per_run_secret(tmp_path: Path) -> None:
    cluster = LocalCluster(_spec("etcd"), run_dir=tmp_path)
    with cluster:
        wait_for(lambda: len(live_workers(tmp_path)) == 2, timeout=90,
                 what="a worker on every node")  # fmt: skip
        secret_file = tmp_path / "rdzv-secret"
        mode = secret_file.stat().st_mode
        assert stat.S_IMODE(mode) == 0o600 and secret_file.stat().st_uid == os.getuid()
        secret = secret_file.read_text().strip()
        assert re.fullmatch(r"[0-9a-f]{64}", secret)
        # Both agents rendezvoused with values signed by the secret (kind S), not unsigned.
        state = _state_value(cluster.endpoint, cluster.run_id, cluster.etcd_login)
        assert state is not None and state.startswith(b"ETv3S")
        # The embedded etcd lets in only the run's own user: not a process that
        # merely found the port, nor one that guesses the user without the password.
        assert cluster.etcd_login["ETCD_USERNAME"] == "elastic-train"
        password = cluster.etcd_login["ETCD_PASSWORD"]
        assert re.fullmatch(r"[0-9a-f]{64}", password)
        with pytest.raises(EtcdError, match=r"needs authentication.*ETCD_USERNAME"):
            _state_value(cluster.endpoint, cluster.run_id, {})
        guess = {"ETCD_USERNAME": "elastic-train", "ETCD_PASSWORD": "0" * 64}
        with pytest.raises(EtcdError, match="rejected the credentials"):
            _state_value(cluster.endpoint, cluster.run_id, guess)
        # The secret is in no argument and no environment of the run's processes (the
        # agents' launcher included), nor in what the agents were forked with.
        agents = [psutil.Process(node.proc.pid) for node in cluster.nodes.values()]
        procs = [p for a in agents for p in [a, *proctree.descendants(a)]]
        procs += [p for p in psutil.Process().children() if p.pid == cluster.launcher_pid]
        assert len(procs) >= 5
        for proc in procs:
            assert secret not in " ".join(proc.cmdline())
            assert secret not in " ".join(proc.environ().values())
            assert password not in " ".join(proc.cmdline())  # the environment carries it
        assert all(isinstance(node.proc, ForkedAgent) for node in cluster.nodes.values())
        assert secret not in " ".join([*cluster.command(), *cluster.node_env(0).values()])
        assert f"secret_file={secret_file}" in " ".join(cluster.command())
        (tmp_path / "finish").touch()
    logs = "".join(p.read_text() for p in (tmp_path / "logs").iterdir())
    assert secret not in logs and password not in logs
    assert not secret_file.exists(), "the secret goes with the run"


@pytest.mark.parametrize(("backend", "conf"), [("etcd-v2", ""), ("etcd", "username=me")])
def test_the_embedded_etcd_stays_open_where_the_agents_could_not_log_in(
    backend: str, conf: str, tmp_path: Path
) -> None:
    # torch's v2 backend has no v3 credentials; a conf with a user of its own would
    # log in as that user, whom the embedded etcd does not know.
    server, login = start_embedded_etcd(backend=backend, rdzv_conf=conf, data_dir=tmp_path / "d")
    try:
        assert login == {}
        assert _state_value(server.endpoint, "run", {}) is None  # read anonymously
    finally:
        server.stop()
