"""The job secret of a local run: generated per run, handed to our backend as ``secret_file``.

The etcd v3 backend signs every value it writes with the job secret and
refuses to start without one unless ``--rdzv-conf insecure=true`` is given
(docs/security.md). A local run therefore makes one: 64 hex characters from
:mod:`secrets` in a 0600 file of the run directory, named in ``--rdzv-conf`` by
its path, so the secret itself is never in an argument, an environment
variable or a log. The competitors the benchmarks run (``c10d``, torch's
``etcd-v2``) do not know the key and get nothing.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from elastic_train.errors import ConfigError

#: the backends served by elastic_train's etcd v3 rendezvous (``torchrun.handlers``)
SIGNING_BACKENDS = frozenset({"etcd", "etcd-v3"})
#: the environment variable the backend reads a secret from when no ``secret_file`` is given
SECRET_ENV = "ELASTIC_TRAIN_RDZV_SECRET"
SECRET_FILE_NAME = "rdzv-secret"


def parse_rdzv_conf(conf: str) -> dict[str, str]:
    """``key=value,...`` as torchrun parses ``--rdzv-conf``; a bad item names itself."""
    parsed: dict[str, str] = {}
    for item in (part.strip() for part in conf.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"rdzv_conf item {item!r} is not key=value")
        parsed[key.strip()] = value.strip()
    return parsed


def secret_source(backend: str, conf: str, env: Mapping[str, str]) -> str | None:
    """Where the agents' secret comes from without ours: ``rdzv_conf``, ``env``,
    ``insecure``, ``not_signed`` (another backend), or None: the run must make one."""
    if backend not in SIGNING_BACKENDS:
        return "not_signed"
    parsed = parse_rdzv_conf(conf)
    if parsed.get("secret_file"):
        return "rdzv_conf"
    if parsed.get("insecure", "").lower() == "true":  # what the backend accepts: true, false
        return "insecure"
    if env.get(SECRET_ENV, "").strip():
        return "env"
    return None


def planned_secret_file(
    backend: str, conf: str, env: Mapping[str, str], run_dir: Path
) -> tuple[Path | None, str]:
    """``(file to make or None, source)`` for a run in ``run_dir``; see :func:`secret_source`."""
    source = secret_source(backend, conf, env)
    if source is not None:
        return None, source
    path = run_dir / SECRET_FILE_NAME
    if "," in str(path):
        raise ConfigError(f"run_dir {run_dir} contains ',', which --rdzv-conf items are split at")
    return path, "generated"


def write_secret_file(path: Path) -> Path:
    """A fresh secret in a new 0600 file at ``path`` (an old file or link there is replaced)."""
    path.unlink(missing_ok=True)
    # O_EXCL | O_NOFOLLOW: never write through a link someone planted in the run dir.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32) + "\n")
    return path


def with_secret_file(conf: str, path: Path) -> str:
    """``conf`` plus ``secret_file=path``."""
    return f"{conf},secret_file={path}" if conf.strip() else f"secret_file={path}"
