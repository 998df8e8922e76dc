"""How a worker reaches the job's etcd: our torchrun plugin's hand-over.

The agent's plugin (``torchrun_plugin.inprocess_etcd_env``) writes the
endpoints, TLS file paths, user name, key prefix and the secret *file* path
as JSON into :data:`ETCD_ENV`, which the workers inherit. In-process recovery
(``training/membership.py``), async joins (``training/admission.py``) and the
exit barrier read it back here, and open their etcd client and value codec
from it. Secrets and passwords never travel in it: they stay in
``secret_file``, ``ELASTIC_TRAIN_RDZV_SECRET`` and ``ETCD_PASSWORD``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from elastic_train.errors import ConfigError
from elastic_train.etcd.client import EtcdClient, EtcdClientConfig
from elastic_train.etcd.codec import SECRET_ENV, ValueCodec, read_job_secret

__all__ = ["ETCD_ENV", "EtcdAccess", "json_from_env"]

#: Set by the torchrun plugin in the agent (inherited by the workers): how to
#: reach the rendezvous etcd, as JSON. Never holds a secret or a password: those
#: come from ``secret_file``, ``ELASTIC_TRAIN_RDZV_SECRET`` and ``ETCD_PASSWORD``.
ETCD_ENV = "ELASTIC_TRAIN_INPROCESS_ETCD"

T = TypeVar("T")


def json_from_env(
    name: str, build: Callable[[dict[str, Any]], T], environ: Mapping[str, str] = os.environ
) -> T | None:
    """``build`` of the JSON object in environment variable ``name`` (our torchrun
    plugin's hand-over to its workers); None when it is unset, a ConfigError naming
    the variable when it does not parse or does not fit."""
    raw = environ.get(name)
    if not raw:
        return None
    try:
        return build(json.loads(raw))
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"environment variable {name} is malformed: {exc}") from exc


@dataclass(frozen=True)
class EtcdAccess:
    """What a worker needs to reach the job's etcd: the JSON of :data:`ETCD_ENV`."""

    endpoints: tuple[str, ...]
    prefix: str  # {key_prefix}/{run_id}
    protocol: str = "http"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    username: str | None = None
    secret_file: str | None = None
    insecure: bool = False
    #: torchrun's --nnodes minimum: fewer live nodes go to the restart path, which waits
    min_nodes: int = 1
    #: torchrun's --nnodes maximum: async joins admit no node beyond it
    max_nodes: int = 1 << 30

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def find(cls, environ: Mapping[str, str] = os.environ) -> EtcdAccess | None:
        """The hand-over, None when this worker was not started by our torchrun plugin."""
        return json_from_env(
            ETCD_ENV, lambda f: cls(**{**f, "endpoints": tuple(f["endpoints"])}), environ
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> EtcdAccess:
        access = cls.find(environ)
        if access is None:
            raise ConfigError(
                "elastic.recovery = 'inprocess' needs the etcd rendezvous: start the workers "
                "with torchrun --rdzv-backend etcd (or etcd-v3) and elastic_train installed, "
                f"which sets {ETCD_ENV}; use elastic.recovery = 'restart' otherwise"
            )
        return access

    def _secret(self, environ: Mapping[str, str]) -> bytes | None:
        """The job secret from ``secret_file``, else the environment; None when none
        reached the worker, a ConfigError when it is there but unusable."""
        try:
            return read_job_secret(self.secret_file, environ)
        except ValueError as exc:
            raise ConfigError(f"elastic.recovery: {exc}") from exc

    def signs(self, environ: Mapping[str, str] = os.environ) -> bool:
        """Whether a secret reached the worker, or the rendezvous runs insecure on purpose;
        a ConfigError for a secret that is there but unusable (unreadable, too short)."""
        return self.insecure or self._secret(environ) is not None

    def codec(self, environ: Mapping[str, str] = os.environ) -> ValueCodec:
        """The job's codec: the secret from ``secret_file``, else the environment."""
        secret = self._secret(environ)
        if secret is None and not self.insecure:
            raise ConfigError(
                "elastic.recovery = 'inprocess': no rendezvous secret reached the worker "
                f"(rdzv-conf secret_file or {SECRET_ENV})"
            )
        return ValueCodec(secret)

    def client(self, environ: Mapping[str, str] = os.environ) -> EtcdClient:
        password = environ.get("ETCD_PASSWORD") if self.username else None
        config = EtcdClientConfig(
            endpoints=self.endpoints, protocol=self.protocol, cacert=self.cacert,
            cert=self.cert, key=self.key, username=self.username, password=password,
            dial_timeout=2.0, read_timeout=2.0,
        )  # fmt: skip
        return EtcdClient(config)
