"""Shared fixtures: a real etcd server per test session on free loopback ports."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rendezvous_threads import stop_handlers

from elastic_train.etcd.server import EtcdServer

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = REPO_ROOT.parent / "shared"


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``pytest -n auto``: two workers, or one on a single core.

    Two is what the suite was tried with on 2 cores (docs/development.md);
    more at once is untested.
    """
    return min(2, len(os.sched_getaffinity(0)))


def pytest_configure(config: pytest.Config) -> None:
    """The torchrun agents the tests start write their per-attempt directories into
    one directory that the session removes (``PET_LOG_DIR`` is torchrun's
    ``--log-dir``): by default each leaves a ``torchelastic_*`` directory in /tmp for
    good. Set before xdist starts its workers, which inherit it."""
    if "PET_LOG_DIR" not in os.environ:
        path = tempfile.mkdtemp(prefix="elastic-train-tests-torchrun-")
        os.environ["PET_LOG_DIR"] = path
        config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with an end-to-end test (marked ``slow``) first, each file's tests
    kept together and in order. xdist hands out whole files (``--dist loadfile``,
    ``--no-loadscope-reorder``), so the short unit files fill the end of the run
    instead of a minute-long end-to-end file starting last on one worker."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd 3.5 (v2 API off, as stock) for the whole session."""
    root = tmp_path_factory.mktemp("etcd")
    server = EtcdServer(data_dir=root / "data", name="session").start()
    yield server
    server.stop()


@pytest.fixture
def etcd_endpoint(etcd_server: EtcdServer) -> str:
    return etcd_server.endpoint


@pytest.fixture(scope="session")
def rdzv_secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job secret for the etcd rendezvous, as `openssl rand -hex 32` makes one, in a
    0600 file: pass ``secret_file=`` it in rdzv-conf (handlers, torchrun agents)."""
    path = tmp_path_factory.mktemp("rdzv-secret") / "secret"
    path.touch(mode=0o600)
    path.write_text(secrets.token_hex(32) + "\n")
    return path


@pytest.fixture
def rdzv_secret(rdzv_secret_file: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The same secret in ``ELASTIC_TRAIN_RDZV_SECRET``, for handlers made in this process."""
    secret = rdzv_secret_file.read_text().strip()
    monkeypatch.setenv("ELASTIC_TRAIN_RDZV_SECRET", secret)
    return secret


@pytest.fixture
def rendezvous_handlers(monkeypatch: pytest.MonkeyPatch, rdzv_secret: str) -> Iterator[None]:
    """For tests that make handlers in this process (``rendezvous_threads.make_handlers``):
    torch's store sharing as an agent has it, the job secret to sign with, and every
    handler stopped afterwards, its heartbeat thread included."""
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    yield
    stop_handlers()


@pytest.fixture(scope="session", autouse=True)
def _remove_session_snapshots() -> Iterator[None]:
    """Remove the /dev/shm snapshot dirs this session's runs left behind.

    Killed nodes and interrupted runs cannot remove their own; /dev/shm is RAM.
    Only directories created after the session started are touched, and only
    when no other pytest session of this user is running: every session holds
    a shared lock for its lifetime, and cleans up only if it can take the lock
    exclusively. Otherwise it would remove the live snapshots of the other
    session's runs (seen: a restart then resumed from disk and lost a step).
    """
    started = time.time()
    lock_path = f"/dev/shm/elastic_train_pytest-{os.getuid()}.lock"
    lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_SH)
    try:
        yield
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another session runs: its snapshots may be among the new ones
        for path in Path("/dev/shm").glob(f"elastic_train-{os.getuid()}-*"):
            with contextlib.suppress(OSError):
                if path.stat().st_mtime >= started:
                    shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(lock)
