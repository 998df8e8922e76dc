"""``--rdzv-endpoint`` and ``--rdzv-conf`` for the etcd v3 rendezvous, parsed and validated.

Every error is a ``ValueError`` that names the key and the accepted values. The
table of keys, defaults and the reasons for them is in
:func:`elastic_train.rendezvous.backend.create_handler` and ``docs/rendezvous.md``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic_train.etcd.client import EtcdClientConfig
from elastic_train.etcd.codec import (
    MAKE_SECRET,
    MIN_SECRET_BYTES,
    SECRET_ENV,
    ValueCodec,
    read_job_secret,
)
from elastic_train.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class HandlerSettings:
    """Settings of torch's handler; the defaults favour fast recovery (see create_handler)."""

    join_timeout: int = 600
    last_call_timeout: float = 1.0
    close_timeout: int = 30
    heartbeat_timeout: int = 5
    keep_alive_interval: int = 1
    keep_alive_max_attempt: int = 3


@dataclass(frozen=True)
class RendezvousConfig:
    """Everything parsed from torchrun's ``--rdzv-endpoint`` and ``--rdzv-conf``."""

    client: EtcdClientConfig
    key_prefix: str = "/elastic_train"
    ttl: int = 7200
    secret: bytes | None = field(default=None, repr=False)
    #: rdzv-conf ``insecure=true``: run unsigned when there is no secret
    insecure: bool = False
    handler: HandlerSettings = HandlerSettings()


_CLIENT_KEYS = ("protocol", "cacert", "cert", "key", "username", "password")
_ACCEPTED_KEYS = frozenset(
    {*_CLIENT_KEYS, "dial_timeout", "read_timeout", "key_prefix", "ttl", "secret_file"}
    | {"insecure"}
    | set(HandlerSettings.__dataclass_fields__)
    # torchrun's launcher always adds "timeout"; the dynamic handler ignores it.
    | {"timeout"}
)


def parse_config(
    params: RendezvousParameters, *, extra_keys: frozenset[str] = frozenset()
) -> RendezvousConfig:
    """Validate ``params``; every error is a ``ValueError`` naming the key and accepted values.

    ``extra_keys`` are rdzv-conf keys that another part of the agent reads
    (the torchrun plugin passes the node agent's); they are accepted unread.
    """
    accepted = _ACCEPTED_KEYS | extra_keys
    unknown = sorted(set(params.config) - accepted)
    if unknown:
        raise ValueError(f"unknown rdzv-conf key(s) {unknown}; accepted keys: {sorted(accepted)}")
    endpoints = tuple(e.strip() for e in (params.endpoint or "").split(",") if e.strip())
    if "password" in params.config:
        log.warning(
            "etcd_password_in_rdzv_conf",
            hint="the process list and torchrun's log show --rdzv-conf; use ETCD_PASSWORD",
        )
    client = EtcdClientConfig(
        endpoints=endpoints,
        protocol=str(params.get("protocol", "http")).strip().lower(),
        cacert=params.get("cacert"),
        cert=params.get("cert"),
        key=params.get("key"),
        username=params.get("username") or os.environ.get("ETCD_USERNAME"),
        password=params.get("password") or os.environ.get("ETCD_PASSWORD"),
        dial_timeout=_number(params, "dial_timeout", 5.0, float),
        read_timeout=_number(params, "read_timeout", 5.0, float),
    )
    handler = HandlerSettings(
        **{
            name: _number(params, name, spec.default, type(spec.default))
            for name, spec in HandlerSettings.__dataclass_fields__.items()
        }
    )
    key_prefix = str(params.get("key_prefix", "/elastic_train")).rstrip("/")
    if not key_prefix.startswith("/"):
        raise ValueError(
            f"key_prefix={key_prefix!r} is invalid; accepted values: an absolute key "
            "prefix such as /elastic_train"
        )
    return RendezvousConfig(
        client=client,
        key_prefix=key_prefix,
        ttl=int(_number(params, "ttl", 7200, int)),
        secret=read_job_secret(params.get("secret_file")),
        insecure=_flag(params, "insecure"),
        handler=handler,
    )


def value_codec(config: RendezvousConfig) -> ValueCodec:
    """The codec that signs and checks every value of the job in etcd.

    Without a secret the agent refuses to start, unless ``insecure=true`` asks
    for unsigned values; that is logged (``rendezvous_insecure``) at every start,
    because anyone who can write the job's etcd keys can then run code on every
    agent (docs/rendezvous.md).
    """
    if config.secret is not None:
        if config.insecure:
            log.warning(
                "rendezvous_insecure_ignored", reason="a job secret is set: values are signed"
            )
        return ValueCodec(config.secret)
    if not config.insecure:
        raise ValueError(
            "no rendezvous secret: every value the agents keep in etcd is signed with a job "
            f"secret of at least {MIN_SECRET_BYTES} bytes. Give the same one to every agent "
            f"in rdzv-conf secret_file=PATH or in the environment variable {SECRET_ENV} "
            f"({MAKE_SECRET}), or pass rdzv-conf insecure=true to run unsigned (then anyone "
            "who can write the job's etcd keys can run code on every agent)"
        )
    log.warning(
        "rendezvous_insecure",
        risk="values in etcd are unsigned: anyone who can write the job's keys can run code "
        "on every agent",
        fix=f"give every agent rdzv-conf secret_file=PATH or {SECRET_ENV}",
    )
    return ValueCodec(None)


def _flag(params: RendezvousParameters, key: str) -> bool:
    raw = params.get(key, "false")
    text = str(raw).strip().lower()
    if text not in ("true", "false"):
        raise ValueError(f"rdzv-conf {key}={raw!r} is invalid; accepted values: true, false")
    return text == "true"


def _number(params: RendezvousParameters, key: str, default: Any, kind: type) -> Any:
    raw = params.get(key, default)
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or not value > 0 or isinstance(raw, bool):
        raise ValueError(
            f"rdzv-conf {key}={raw!r} is invalid; accepted values: a positive "
            f"{'integer' if kind is int else 'number'} of "
            f"{'attempts' if 'attempt' in key else 'seconds'}"
        )
    return value
