"""How the rendezvous backend frames the values it keeps in etcd.

torch's handler stores its state as a *pickle*, so whoever can write the state
key could run code on every agent that reads it. Every value therefore carries
a tag, checked before its bytes go anywhere:

    b"ETv3" | kind (1 byte) | tag (32 bytes) | payload

- kind ``S``: the tag is HMAC-SHA256 over ``key + b"\\n" + payload`` with the job
  secret (rdzv-conf ``secret_file`` or ``ELASTIC_TRAIN_RDZV_SECRET``). Binding
  the key stops a signed value from being replayed under another key or run.
- kind ``D``: no secret; the tag is SHA-256 of the payload, which catches
  corruption and values not written by this backend.
"""

from __future__ import annotations

import hashlib
import hmac

from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from elastic_train.log import get_logger
from elastic_train.rendezvous.config import SECRET_ENV

__all__ = ["ValueCodec"]

log = get_logger(__name__)

_MAGIC = b"ETv3"
_SIGNED, _DIGEST = b"S", b"D"
_HEADER_LEN = len(_MAGIC) + 1 + hashlib.sha256().digest_size


class ValueCodec:
    """Frames and checks the values of one job; ``secret=None`` means unsigned."""

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret

    def encode(self, key: bytes, payload: bytes) -> bytes:
        if self._secret is None:
            return _MAGIC + _DIGEST + hashlib.sha256(payload).digest() + payload
        return _MAGIC + _SIGNED + self._mac(key, payload) + payload

    def decode(self, key: bytes, value: bytes) -> bytes:
        """The payload of ``value`` read at ``key``; :class:`RendezvousStateError` if refused."""
        kind, tag, payload = value[4:5], value[5:_HEADER_LEN], value[_HEADER_LEN:]
        if (
            not value.startswith(_MAGIC)
            or len(value) < _HEADER_LEN
            or kind not in (_SIGNED, _DIGEST)
        ):
            _reject(key, "corrupt", "not written by elastic_train's etcd v3 backend")
        if kind == _DIGEST and self._secret is not None:
            _reject(key, "unsigned", "a job secret is set, so unsigned values are refused")
        if kind == _SIGNED and self._secret is None:
            _reject(key, "signed", f"it is signed but no job secret is set ({SECRET_ENV})")
        expected = self._mac(key, payload) if kind == _SIGNED else hashlib.sha256(payload).digest()
        if not hmac.compare_digest(tag, expected):
            _reject(key, "bad_signature" if kind == _SIGNED else "corrupt", "checksum mismatch")
        return payload

    def _mac(self, key: bytes, payload: bytes) -> bytes:
        assert self._secret is not None
        return hmac.new(self._secret, key + b"\n" + payload, hashlib.sha256).digest()


def _reject(key: bytes, reason: str, detail: str) -> None:
    name = key.decode(errors="replace")
    log.error("rendezvous_state_rejected", key=name, reason=reason, detail=detail)
    raise RendezvousStateError(f"refused the rendezvous value at etcd key {name!r}: {detail}")
