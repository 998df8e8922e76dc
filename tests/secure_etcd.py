"""An etcd secured the way deploy/etcd/ sets one up: certificates from
``make-certs.sh`` (client certificates required) and the rendezvous user,
its prefix-limited role and authentication from ``create-rendezvous-user.sh``."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from elastic_train.etcd.server import EtcdServer, find_etcd_binary

ETCD_SCRIPTS = Path(__file__).resolve().parents[1] / "deploy" / "etcd"
ROOT_PASSWORD = "root-secret"
PASSWORD = "rendezvous-secret"


@dataclass(frozen=True)
class SecureEtcd:
    server: EtcdServer
    certs: Path
    #: etcdctl's environment: endpoint, CA and client certificate, passwords.
    ctl_env: dict[str, str]

    def create_user(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(ETCD_SCRIPTS / "create-rendezvous-user.sh")],
            env=self.ctl_env, capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip


@contextlib.contextmanager
def secure_etcd(root: Path) -> Iterator[SecureEtcd]:
    certs = root / "certs"
    subprocess.run(
        ["bash", str(ETCD_SCRIPTS / "make-certs.sh"), str(certs)], check=True, capture_output=True
    )
    server = EtcdServer(
        data_dir=root / "etcd" / "data", name="tls", client_scheme="https",
        extra_args=(
            "--client-cert-auth", f"--trusted-ca-file={certs / 'ca.crt'}",
            f"--cert-file={certs / 'server.crt'}", f"--key-file={certs / 'server.key'}",
        ),
    ).start()  # fmt: skip
    try:
        ctl_env = {
            **os.environ, "PATH": f"{Path(find_etcd_binary()).parent}:{os.environ['PATH']}",
            "ETCDCTL_API": "3", "ETCDCTL_ENDPOINTS": server.client_url,
            "ETCDCTL_CACERT": str(certs / "ca.crt"), "ETCDCTL_CERT": str(certs / "client.crt"),
            "ETCDCTL_KEY": str(certs / "client.key"),
            "ETCD_ROOT_PASSWORD": ROOT_PASSWORD, "ETCD_PASSWORD": PASSWORD,
        }  # fmt: skip
        etcd = SecureEtcd(server=server, certs=certs, ctl_env=ctl_env)
        created = etcd.create_user()
        assert created.returncode == 0, created.stderr
        yield etcd
    finally:
        server.stop()


def trainer_secrets(certs: Path) -> dict[str, dict[str, str]]:
    """The Secrets the etcd-tls component mounts into trainer pods (docs/deploy.md)."""
    pem = {name: (certs / name).read_text() for name in ("ca.crt", "client.crt", "client.key")}
    return {"etcd-client-tls": pem, "etcd-rendezvous-auth": {"password": PASSWORD}}
