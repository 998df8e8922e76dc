"""The embedded etcd of a local run, with authentication on before any agent starts.

Without authentication, any process of any user on the machine that finds the
loopback port can read and rewrite the run's keys. The job secret keeps such
a process from running code in the job (every value is signed and checked),
not from deleting keys and so stopping the run. So the embedded etcd gets two
users: ``root``, with a random password that nobody keeps, and
:data:`AGENT_USER`, with readwrite on every key and no say over users or roles,
whose random password reaches the agents (and their workers) in
``ETCD_PASSWORD``: their environment, never an argument, a file or a log line
(``log.py`` redacts it). Both live only as long as the run's etcd.

``etcd-v2`` gets no authentication: torch's v2 backend has no v3 credentials.
Neither does a run whose ``rdzv_conf`` names a ``username`` of its own.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from elastic_train.etcd.client import EtcdClient, EtcdClientConfig
from elastic_train.etcd.server import EtcdServer
from elastic_train.local.rdzv_secret import SIGNING_BACKENDS, parse_rdzv_conf

__all__ = ["AGENT_USER", "start_embedded_etcd"]

AGENT_USER = "elastic-train"
#: bcrypt's lowest cost. The passwords are 256 random bits, which no cost makes
#: stronger, and every agent's and worker's login pays it: 2-3 ms a login here,
#: 66 ms at etcd's default cost (10), measured on the 2-core box.
BCRYPT_COST = 4


def start_embedded_etcd(
    *, backend: str, rdzv_conf: str, data_dir: Path
) -> tuple[EtcdServer, dict[str, str]]:
    """A started etcd for the run and the environment its agents log in with
    (``ETCD_USERNAME``, ``ETCD_PASSWORD``; empty where authentication stays off)."""
    extra = ("--enable-v2",) if backend == "etcd-v2" else (f"--bcrypt-cost={BCRYPT_COST}",)
    server = EtcdServer(data_dir=data_dir, extra_args=extra).start()
    # Only our v3 backend logs in; a username of the conf's own is no user of this etcd.
    if backend not in SIGNING_BACKENDS or "username" in parse_rdzv_conf(rdzv_conf):
        return server, {}
    password = secrets.token_hex(32)
    client = EtcdClient(EtcdClientConfig(endpoints=(server.endpoint,)))
    try:
        client.enable_auth(root_password=secrets.token_hex(32), user=AGENT_USER, password=password)
    except BaseException:
        server.stop()
        raise
    finally:
        client.close()
    return server, {"ETCD_USERNAME": AGENT_USER, "ETCD_PASSWORD": password}
