"""A small etcd v3 client: the only module that imports ``pyetcd`` (and gRPC).

It uses the generated protobuf stubs of ``etcd-sdk-python`` (``pyetcd.etcdrpc``)
and adds what its client object lacks: bounded connection time
(``dial_timeout``), a deadline on every request (``read_timeout``), failover
across the members of a cluster, re-authentication when a token expires, and
translation of every gRPC error into :mod:`elastic_train.errors` types whose
message names the endpoint. Callers never see ``grpc.RpcError``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from pyetcd import etcdrpc

from elastic_train import metrics
from elastic_train.errors import EtcdError, EtcdUnavailableError
from elastic_train.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")

DEFAULT_PORT = 2379
PROTOCOLS = ("http", "https")
# Errors that say "this member cannot serve now": try the next endpoint.
_FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# etcd's ErrGRPCNotLeader (FailedPrecondition): a member that is not the leader, as
# during an election (lease calls), where another member may be the leader already.
_NOT_LEADER = "etcdserver: not leader"


@dataclass(frozen=True)
class EtcdClientConfig:
    """How to reach an etcd cluster. Validated on construction."""

    endpoints: tuple[str, ...]
    protocol: str = "http"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    dial_timeout: float = 5.0
    read_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol={self.protocol!r} is invalid; accepted values: http, https")
        if not self.endpoints:
            raise ValueError("endpoint is empty; give host[:port][,host[:port]...]")
        for endpoint in self.endpoints:
            parse_endpoint(endpoint, protocol=self.protocol)
        tls_files = {"cacert": self.cacert, "cert": self.cert, "key": self.key}
        if any(tls_files.values()) and self.protocol != "https":
            raise ValueError("cacert, cert and key need protocol=https (accepted: http, https)")
        if bool(self.cert) != bool(self.key):
            raise ValueError("cert and key must be given together (client certificate and key)")
        for name, path in tls_files.items():
            if path and not Path(path).is_file():
                raise ValueError(f"{name}={path!r}: no such file")
        if (self.username is None) != (self.password is None):
            raise ValueError("username and password must be given together")
        for name in ("dial_timeout", "read_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive number")


def parse_endpoint(endpoint: str, *, protocol: str) -> tuple[str, int]:
    """``[scheme://]host[:port]`` -> ``(host, port)``; a scheme must match ``protocol``."""
    rest = endpoint.strip()
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if scheme != protocol:
            raise ValueError(
                f"endpoint {endpoint!r} uses {scheme}:// but protocol={protocol}; "
                "set protocol to match (accepted: http, https)"
            )
    rest = rest.rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or host.endswith(":"):  # no port, or a bare IPv6 address
        host, port = rest, str(DEFAULT_PORT)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {endpoint!r} is invalid; expected host[:port]")
    return host, int(port)


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int


@dataclass(frozen=True)
class WatchEvent:
    deleted: bool
    kv: KeyValue  # for a deletion: the key and the revision of the delete


def _kv(raw: Any) -> KeyValue:
    return KeyValue(key=raw.key, value=raw.value, mod_revision=raw.mod_revision)


class _Member:
    """One endpoint: its channel and stubs."""

    def __init__(self, target: str, config: EtcdClientConfig) -> None:
        self.target = target
        host, port = parse_endpoint(target, protocol=config.protocol)
        self.name = f"{config.protocol}://{host}:{port}"
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        dial_ms = int(config.dial_timeout * 1000)
        options = [
            # gRPC uses the minimum reconnect backoff as its connect timeout.
            ("grpc.min_reconnect_backoff_ms", dial_ms),
            # Notice a restarted member within a second instead of up to 2 min.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            # HTTP/2 pings find a dead connection under a long watch within 15 s;
            # pings are not requests, so an idle agent stays silent (etcd accepts
            # one every 5 s, --grpc-keepalive-min-time).
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        if config.protocol == "https":
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(config.cacert),
                private_key=_read(config.key),
                certificate_chain=_read(config.cert),
            )
            self.channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.kv = etcdrpc.KVStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)
        self.watch = etcdrpc.WatchStub(self.channel)
        self.auth = etcdrpc.AuthStub(self.channel)
        self.maintenance = etcdrpc.MaintenanceStub(self.channel)


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


class EtcdClient:
    """Thread-safe etcd v3 client with failover; see the module docstring."""

    def __init__(self, config: EtcdClientConfig) -> None:
        self.config = config
        self._members = [_Member(e, config) for e in config.endpoints]
        self._current = 0
        self._token: str | None = None
        self._lock = threading.Lock()

    @property
    def endpoints(self) -> str:
        return ",".join(m.name for m in self._members)

    def close(self) -> None:
        for member in self._members:
            member.channel.close()

    # -- requests ---------------------------------------------------------------------------

    def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """The key's value (or ``None``) and the store revision of the read."""
        resp = self._call(lambda m, kw: m.kv.Range(etcdrpc.RangeRequest(key=key), **kw), op="range")
        return (_kv(resp.kvs[0]) if resp.kvs else None), resp.header.revision

    def get_prefix(
        self, prefix: bytes, *, count_only: bool = False, start: bytes | None = None
    ) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (or none, with the count as revision's partner);
        with ``start`` (a key under ``prefix``), those from ``start`` on."""
        request = etcdrpc.RangeRequest(
            key=start or prefix, range_end=_prefix_end(prefix), count_only=count_only
        )
        resp = self._call(lambda m, kw: m.kv.Range(request, **kw), op="range")
        if count_only:
            return [], resp.count
        return [_kv(kv) for kv in resp.kvs], resp.header.revision

    def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Unconditional write; returns the new revision."""
        request = etcdrpc.PutRequest(key=key, value=value, lease=lease)
        return self._call(lambda m, kw: m.kv.Put(request, **kw), op="put").header.revision

    def put_if_revision(
        self, key: bytes, value: bytes, *, mod_revision: int, lease: int = 0
    ) -> tuple[bool, KeyValue | None, int]:
        """Write if the key's ``mod_revision`` matches (0: only if absent).

        Returns ``(written, current value if not written, revision)``: one transaction.
        """
        compare = etcdrpc.Compare(
            key=key,
            target=etcdrpc.Compare.MOD,
            result=etcdrpc.Compare.EQUAL,
            mod_revision=mod_revision,
        )
        return self._txn(compare, key, value, lease)

    def put_if_value(
        self, key: bytes, value: bytes, *, expected: bytes | None, lease: int = 0
    ) -> tuple[bool, KeyValue | None, int]:
        """Write if the key holds ``expected`` (``None``: only if absent); one transaction."""
        if expected is None:
            compare = etcdrpc.Compare(
                key=key, target=etcdrpc.Compare.VERSION, result=etcdrpc.Compare.EQUAL, version=0
            )
        else:
            compare = etcdrpc.Compare(
                key=key, target=etcdrpc.Compare.VALUE, result=etcdrpc.Compare.EQUAL, value=expected
            )
        return self._txn(compare, key, value, lease)

    def _txn(
        self, compare: Any, key: bytes, value: bytes, lease: int
    ) -> tuple[bool, KeyValue | None, int]:
        request = etcdrpc.TxnRequest(
            compare=[compare],
            success=[
                etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=value, lease=lease))
            ],
            failure=[etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key))],
        )
        resp = self._call(lambda m, kw: m.kv.Txn(request, **kw), op="txn")
        if resp.succeeded:
            return True, None, resp.header.revision
        kvs = resp.responses[0].response_range.kvs
        return False, (_kv(kvs[0]) if kvs else None), resp.header.revision

    def put_and_delete_if_revisions(
        self,
        *,
        expected: list[tuple[bytes, int]],
        put: tuple[bytes, bytes, int],
        deletes: list[bytes],
    ) -> tuple[bool, int]:
        """One transaction: if every ``(key, mod_revision)`` of ``expected`` still holds, put
        ``put = (key, value, lease)`` and delete ``deletes``. Returns ``(written, revision)``.

        etcd refuses more than ``--max-txn-ops`` (128 by default) compares or operations.
        """
        compares = [
            etcdrpc.Compare(
                key=key, target=etcdrpc.Compare.MOD, result=etcdrpc.Compare.EQUAL, mod_revision=rev
            )
            for key, rev in expected
        ]
        key, value, lease = put
        ops = [etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=value, lease=lease))]
        ops += [
            etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=k))
            for k in deletes
        ]
        request = etcdrpc.TxnRequest(compare=compares, success=ops)
        resp = self._call(lambda m, kw: m.kv.Txn(request, **kw), op="txn")
        return bool(resp.succeeded), resp.header.revision

    def revoke_lease(self, lease_id: int) -> None:
        """End a lease now: etcd deletes every key attached to it."""
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        self._call(lambda m, kw: m.lease.LeaseRevoke(request, **kw), op="lease_revoke")

    def delete(self, key: bytes) -> bool:
        request = etcdrpc.DeleteRangeRequest(key=key)
        return self._call(lambda m, kw: m.kv.DeleteRange(request, **kw), op="delete").deleted > 0

    def server_version(self) -> str:
        """The etcd version (``"3.5.17"``) of the member that answers: Maintenance ``Status``."""
        request = etcdrpc.StatusRequest()
        resp = self._call(lambda m, kw: m.maintenance.Status(request, **kw), op="status")
        return str(resp.version)

    def grant_lease(self, ttl: int) -> int:
        request = etcdrpc.LeaseGrantRequest(TTL=ttl)
        return self._call(lambda m, kw: m.lease.LeaseGrant(request, **kw), op="lease_grant").ID

    def refresh_lease(self, lease_id: int) -> int:
        """Renew a lease once; returns its new TTL, 0 when it has already expired."""

        def keep_alive(member: _Member, kw: dict[str, Any]) -> int:
            responses = member.lease.LeaseKeepAlive(
                iter([etcdrpc.LeaseKeepAliveRequest(ID=lease_id)]), **kw
            )
            try:
                return next(iter(responses)).TTL
            finally:
                responses.cancel()

        return self._call(keep_alive, op="lease_keepalive")

    def watch_once(self, key: bytes, *, prefix: bool, start_revision: int, timeout: float) -> bool:
        """Block until a change at or after ``start_revision`` (True) or ``timeout`` (False).

        May also return True spuriously (a compacted revision, a member going away):
        callers re-read, so a spurious wake-up costs one request.
        """
        outcome = self.watch(
            key,
            prefix=prefix,
            start_revision=start_revision,
            timeout=timeout,
            on_events=lambda _: True,
        )
        return outcome != "timeout"

    def watch(
        self,
        key: bytes,
        *,
        prefix: bool,
        start_revision: int,
        timeout: float,
        on_events: Callable[[list[WatchEvent]], bool],
    ) -> str:
        """Stream changes from ``start_revision`` to ``on_events`` until it returns True
        (``"stopped"``), ``timeout`` passes (``"timeout"``) or the stream ends (``"broken"``:
        a member went away, a compacted revision; the caller re-reads and watches again)."""
        request = etcdrpc.WatchRequest(
            create_request=etcdrpc.WatchCreateRequest(
                key=key,
                range_end=_prefix_end(key) if prefix else b"",
                start_revision=start_revision,
            )
        )
        done = threading.Event()

        def requests() -> Iterator[Any]:
            yield request
            done.wait()  # etcd ends the watch when the client half-closes

        member = self._members[self._current]
        end = time.monotonic() + timeout
        kwargs = self._call_kwargs(timeout)
        # A member cut off from its leader ends the stream instead of going quiet.
        kwargs["metadata"] = (*(kwargs["metadata"] or ()), ("hasleader", "true"))
        responses = member.watch.Watch(requests(), **kwargs)
        try:
            for resp in responses:
                if resp.compact_revision or resp.canceled:
                    return "broken"
                events = [WatchEvent(deleted=e.type == e.DELETE, kv=_kv(e.kv)) for e in resp.events]
                if events and on_events(events):
                    return "stopped"
            return "broken"
        except grpc.RpcError as exc:
            # etcd may end an expired stream with UNKNOWN "context deadline exceeded".
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() >= end:
                return "timeout"
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._advance(member)
                return "broken"
            raise self._translate(exc, member) from exc
        finally:
            done.set()
            responses.cancel()

    def enable_auth(self, *, root_password: str, user: str, password: str) -> None:
        """Turn authentication on in an etcd that has none yet: ``root``, and ``user``
        with readwrite on every key and no say over users or roles."""
        role, readwrite = f"{user}-readwrite", etcdrpc.Permission.READWRITE
        every_key = etcdrpc.Permission(permType=readwrite, key=b"\0", range_end=b"\0")
        grant = etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=every_key)
        requests = (
            ("UserAdd", etcdrpc.AuthUserAddRequest(name="root", password=root_password)),
            ("UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user="root", role="root")),
            ("RoleAdd", etcdrpc.AuthRoleAddRequest(name=role)),
            ("RoleGrantPermission", grant),
            ("UserAdd", etcdrpc.AuthUserAddRequest(name=user, password=password)),
            ("UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user=user, role=role)),
            ("AuthEnable", etcdrpc.AuthEnableRequest()),
        )
        for method, request in requests:
            self._call(lambda m, kw, f=method, r=request: getattr(m.auth, f)(r, **kw), op="auth")

    # -- plumbing -----------------------------------------------------------------------------

    def _call_kwargs(self, timeout: float) -> dict[str, Any]:
        metadata = (("token", self._token),) if self._token else None
        return {"timeout": timeout, "metadata": metadata}

    def _call(self, rpc: Callable[[_Member, dict[str, Any]], T], *, op: str) -> T:
        """Run ``rpc`` on the current member, failing over until ``dial_timeout`` has passed
        and every member has been tried; timed, and counted as an error if it raises."""
        with metrics.etcd_timer(op):
            return self._call_with_failover(rpc)

    def _call_with_failover(self, rpc: Callable[[_Member, dict[str, Any]], T]) -> T:
        deadline = time.monotonic() + self.config.dial_timeout
        failures: dict[str, str] = {}
        reauthenticated = False
        while True:
            member = self._members[self._current]
            try:
                if self.config.username is not None and self._token is None:
                    self._authenticate(member)
                result = rpc(member, self._call_kwargs(self.config.read_timeout))
                if failures:
                    log.warning("etcd_failover", failed=failures, now=member.name)
                return result
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAUTHENTICATED and not reauthenticated:
                    # Tokens expire (etcd --auth-token-ttl); log in again once.
                    self._token, reauthenticated = None, True
                    continue
                if not fails_over(exc):
                    raise self._translate(exc, member) from exc
                failures[member.name] = _details(exc)
                self._advance(member)
                tried_all = len(failures) == len(self._members)
                if tried_all and all(_is_tls_failure(c) for c in failures.values()):
                    # A certificate problem does not heal by retrying.
                    causes = _causes(failures)
                    raise EtcdError(f"TLS handshake with etcd failed ({causes})") from exc
                if time.monotonic() >= deadline and tried_all:
                    causes = _causes(failures)
                    raise EtcdUnavailableError(f"no etcd endpoint answered ({causes})") from exc
                if tried_all:
                    time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _authenticate(self, member: _Member) -> None:
        request = etcdrpc.AuthenticateRequest(
            name=self.config.username, password=self.config.password
        )
        resp = member.auth.Authenticate(request, timeout=self.config.read_timeout)
        self._token = resp.token

    def _advance(self, failed: _Member) -> None:
        with self._lock:
            if self._members[self._current] is failed:
                self._current = (self._current + 1) % len(self._members)

    def _translate(self, exc: grpc.RpcError, member: _Member) -> EtcdError:
        code, details = exc.code(), _details(exc)
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return EtcdError(
                f"etcd at {member.name} denied the request ({details}); the etcd user "
                f"{self.config.username!r} needs readwrite on the key prefix"
            )
        if code == grpc.StatusCode.INVALID_ARGUMENT and "authentication failed" in details:
            return EtcdError(
                f"etcd at {member.name} rejected the credentials of user "
                f"{self.config.username!r} ({details})"
            )
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
            return LeaseExpiredError(f"etcd at {member.name}: {details}")
        if code == grpc.StatusCode.UNAUTHENTICATED or "user name is empty" in details:
            return EtcdError(
                f"etcd at {member.name} needs authentication ({details}); "
                "give its user in ETCD_USERNAME and ETCD_PASSWORD"
            )
        return EtcdError(f"etcd at {member.name} failed the request: {code.name}: {details}")


class LeaseExpiredError(EtcdError):
    """A write named a lease that has expired (etcd was unreachable for its whole TTL)."""


def fails_over(exc: grpc.RpcError) -> bool:
    """Whether another member may serve what this one refused."""
    code = exc.code()
    not_leader = code == grpc.StatusCode.FAILED_PRECONDITION and _NOT_LEADER in _details(exc)
    return code in _FAILOVER_CODES or not_leader


def _details(exc: grpc.RpcError) -> str:
    details = exc.details() if hasattr(exc, "details") else None
    return str(details or exc)


def _is_tls_failure(details: str) -> bool:
    lowered = details.lower()
    return "ssl" in lowered or "handshake" in lowered or "certificate" in lowered


def _causes(failures: dict[str, str]) -> str:
    return "; ".join(f"{name}: {cause}" for name, cause in failures.items())


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key that starts with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"  # every key
    return stripped[:-1] + bytes([stripped[-1] + 1])
