"""How every value we keep in etcd is framed and checked: the rendezvous state, the
heartbeat keys and the torch Store's values all go through one :class:`ValueCodec`.

torch's handler stores its state as a *pickle*, and the Store hands workers the
master address; whoever could write those keys could run code on, or redirect,
every agent. Every value therefore carries a tag that is checked before its
bytes go anywhere:

    b"ETv3" | kind (1 byte) | tag (32 bytes) | payload

- kind ``S``: the tag is HMAC-SHA256 over ``key + b"\\n" + payload`` with the job
  secret. The key is the full etcd key (``{key_prefix}/{run_id}/...``), so a
  value copied to another key, or from another run, fails the check.
- kind ``D`` (insecure mode only: no secret): the tag is SHA-256 of the payload,
  which catches corruption and values not written by us, but not forgery.

The codec is built once per agent (``rendezvous.config.value_codec``) and
given to the backend and the Store; nothing in this package decides whether a
job may run unsigned.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from elastic_train.errors import EtcdValueRejectedError
from elastic_train.etcd.client import KeyValue
from elastic_train.log import get_logger

__all__ = [
    "MAKE_SECRET",
    "MIN_SECRET_BYTES",
    "SECRET_ENV",
    "ValueCodec",
    "read_job_secret",
    "read_verified",
]

log = get_logger(__name__)

#: The shortest job secret accepted: HMAC-SHA256's own key size.
MIN_SECRET_BYTES = 32
#: The job secret's environment variable (else rdzv-conf ``secret_file``).
SECRET_ENV = "ELASTIC_TRAIN_RDZV_SECRET"
MAKE_SECRET = (
    "make one with `openssl rand -hex 32 > secret && chmod 600 secret` or "
    '`python -c "import secrets; print(secrets.token_hex(32))"`'
)

_MAGIC = b"ETv3"
_SIGNED, _DIGEST = b"S", b"D"
_HEADER_LEN = len(_MAGIC) + 1 + hashlib.sha256().digest_size
#: Reads of one key per refused value: the first and at most two fresh ones.
READ_ATTEMPTS = 3


class ValueCodec:
    """Frames and checks the values of one job; ``secret=None`` means unsigned (insecure)."""

    def __init__(self, secret: bytes | None) -> None:
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the job secret must be at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret

    @property
    def signed(self) -> bool:
        return self._secret is not None

    def encode(self, key: bytes, payload: bytes) -> bytes:
        if self._secret is None:
            return _MAGIC + _DIGEST + hashlib.sha256(payload).digest() + payload
        return _MAGIC + _SIGNED + self._mac(key, payload) + payload

    def decode(self, key: bytes, value: bytes) -> bytes:
        """The payload of ``value`` read at ``key``; :class:`EtcdValueRejectedError` if refused."""
        kind, tag, payload = value[4:5], value[5:_HEADER_LEN], value[_HEADER_LEN:]
        if (
            not value.startswith(_MAGIC)
            or len(value) < _HEADER_LEN
            or kind not in (_SIGNED, _DIGEST)
        ):
            _reject(key, "corrupt", "it was not written by elastic_train")
        if kind == _DIGEST and self._secret is not None:
            _reject(
                key,
                "unsigned",
                "it is unsigned and this agent has a job secret (an agent started with "
                "insecure=true and no secret, or a forgery)",
            )
        if kind == _SIGNED and self._secret is None:
            _reject(
                key,
                "signed",
                "it is signed but this agent has no job secret; give every agent the same "
                "secret_file or ELASTIC_TRAIN_RDZV_SECRET",
            )
        if kind == _DIGEST:
            if not hmac.compare_digest(tag, hashlib.sha256(payload).digest()):
                _reject(key, "corrupt", "checksum mismatch")
        elif not hmac.compare_digest(tag, self._mac(key, payload)):
            _reject(
                key,
                "bad_signature",
                "its HMAC does not match this agent's job secret: written with another "
                "secret, forged, copied from another key or run, or corrupt",
            )
        return payload

    def _mac(self, key: bytes, payload: bytes) -> bytes:
        assert self._secret is not None
        return hmac.new(self._secret, key + b"\n" + payload, hashlib.sha256).digest()


def _reject(key: bytes, reason: str, detail: str) -> None:
    name = key.decode(errors="replace")
    log.error("etcd_value_rejected", key=name, reason=reason, detail=detail)
    raise EtcdValueRejectedError(f"refused the value at etcd key {name!r}: {detail}")


def read_verified(
    codec: ValueCodec,
    key: bytes,
    first: KeyValue | None,
    reread: Callable[[], KeyValue | None],
    *,
    attempts: int = READ_ATTEMPTS,
) -> tuple[bytes, KeyValue] | None:
    """The checked payload of ``first`` (read at ``key``) and the value it came from.

    A refused value is read again with ``reread`` (straight from etcd) at most
    ``attempts - 1`` times, because a refusal can be transient: a copy kept by a
    watch may lag behind a writer that has since replaced the value. A MAC is a
    pure function of key, payload and secret, so a re-read that returns the very
    same value (same bytes, same ``mod_revision``) is refused at once: retrying
    cannot change the verdict, and a forgery is never waited out.
    """
    current, attempt = first, 1
    while current is not None:
        try:
            return codec.decode(key, current.value), current
        except EtcdValueRejectedError:
            fresh = reread() if attempt < attempts else current
            if fresh == current:
                raise
        attempt += 1
        log.warning("etcd_value_reread", key=key.decode(errors="replace"), attempt=attempt)
        current = fresh
    return None


def read_job_secret(
    secret_file: str | None, environ: Mapping[str, str] = os.environ
) -> bytes | None:
    """The job secret from ``secret_file``, else from :data:`SECRET_ENV`; None if
    neither gives one. Surrounding whitespace (the newline ``openssl`` writes) is
    not part of it. An unreadable file or a short secret raises ValueError."""
    if secret_file:
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"secret_file={secret_file!r} cannot be read: {exc.strerror}") from exc
        return _checked_secret(secret, f"secret_file={secret_file!r}")
    from_env = environ.get(SECRET_ENV, "").strip()
    return _checked_secret(from_env.encode(), SECRET_ENV) if from_env else None


def _checked_secret(secret: bytes, source: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the rendezvous secret in {source} is {len(secret)} bytes; it must be at least "
            f"{MIN_SECRET_BYTES} bytes: {MAKE_SECRET}"
        )
    return secret
