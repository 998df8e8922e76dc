"""Node agents forked from one process that imported torch once, for ``elastic-train local``.

Each node of a local run is a torchrun agent. Started as an interpreter of its
own, every agent imports torch and torchrun (2.9 s of CPU on the 2-core box),
and its zygote imports the trainer's heavy parts besides (2.6 s), once per
node and again at every join. The nodes share one machine, so the launcher
here pays that once per run: a child of the runner that imports torch,
torchrun's agent and the environment-free part of what a zygote imports
(:data:`PRELOAD`), then forks one agent per request. The fork runs
``python -m torch.distributed.run ARGS`` in place, as the interpreter would.

A forked agent keeps what a started one has: its own session, its log file as
stdout and stderr, ``/dev/null`` as stdin, its environment, argv and working
directory, and its exit status. It is the launcher's child, so the launcher
reaps it and passes the status on: :class:`ForkedAgent` is what the runner
uses of ``Popen``. What differs: ``/proc/PID/cmdline`` (and ``ps``) shows the
launcher's command line for every agent, and ``/proc/PID/environ`` the
launcher's environment, so the runner logs each node's pid. A node whose
import-time environment (:data:`warm_start.IMPORT_TIME_ENV_PREFIXES`)
differs from the launcher's, or a launcher that failed, starts cold.

Not imported here: gRPC and prometheus-client, which no process may hold
before it forks (a channel's threads; the metrics directory that
prometheus-client reads at import differs per node), and no CUDA call: the
agent's own ``torch.cuda.is_available()`` comes after the fork.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from elastic_train.agent import warm_start
from elastic_train.log import exit_now, get_logger

log = get_logger(__name__)

#: What the launcher imports before it forks: torch, torchrun's agent, and the
#: slow parts of the trainer's imports that read no per-node environment.
PRELOAD = (
    "torch",
    "torch.distributed.launcher.api",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "structlog",
    "psutil",
)
#: The module each fork runs as ``__main__``.
AGENT_MODULE = "torch.distributed.run"
#: Set in each forked agent (so its workers): the launcher's pid, where a tool that
#: walks up from a worker to its node's agent must stop.
LAUNCHER_PID_ENV = "ELASTIC_TRAIN_AGENT_FORKS"
#: Seconds the runner waits for the launcher's imports (several runs may share two cores).
READY_TIMEOUT_S = 120.0
#: Seconds for one fork's reply.
FORK_TIMEOUT_S = 30.0
#: Exit status of an agent whose launcher died before it could report one.
UNKNOWN_EXIT = 255
_MAX_MESSAGE = 1 << 20


class ForkedAgent:
    """What the runner uses of ``subprocess.Popen``, for an agent the launcher forked."""

    def __init__(self, pid: int, forks: AgentForks) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._forks = forks

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._forks.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout or 0.0)
            self._forks.wait_for_news(0.1 if left is None else min(left, 0.1))
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a reaped pid may belong to another process by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


class AgentForks:
    """The runner's side of the launcher: start it, fork agents, learn how they exit."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self._proc = proc
        self._sock = sock
        self._news = threading.Condition()
        self._ready: dict[str, Any] | None = None
        self._replies: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._abandoned: set[int] = set()  # requests whose reply came too late
        self._closed = False
        self._requests = 0
        self._reader = threading.Thread(target=self._read, name="agent-forks", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, *, env: Mapping[str, str], log_path: Path) -> AgentForks:
        """Start the launcher with ``env``, the environment its agents share; it
        imports in the background (:meth:`fork` waits for it)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with open(log_path, "ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", __name__, "--fd", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),), env=dict(env), stdin=subprocess.DEVNULL,
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        log.info("agent_forks_started", pid=proc.pid)
        return cls(proc, ours)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def running(self) -> bool:
        """Whether the launcher still serves (it reports exits)."""
        with self._news:
            return not self._closed

    def fork(
        self, argv: Sequence[str], *, env: Mapping[str, str], log_path: Path,
        module: str = AGENT_MODULE,
    ) -> ForkedAgent | None:  # fmt: skip
        """An agent running ``python -m torch.distributed.run *argv`` (``module``), or None:
        start it cold (the launcher failed, or ``env`` differs from its import-time
        environment)."""
        ready = self._wait_ready()
        if ready is None:
            return None
        if warm_start.import_time_environ(env) != ready["import_env"]:
            log.info("agent_fork_skipped", reason="import-time environment differs")
            return None
        with self._news:
            self._requests += 1
            number = self._requests
        request = {"request": number, "module": module, "argv": list(argv), "log": str(log_path),
                   "env": {**env, LAUNCHER_PID_ENV: str(self.pid)}, "cwd": os.getcwd()}  # fmt: skip
        try:
            self._sock.send(json.dumps(request).encode())
        except OSError as exc:
            log.warning("agent_fork_failed", error=str(exc))
            return None
        reply = self._wait(lambda: self._replies.pop(number, None), FORK_TIMEOUT_S)
        if reply is None:
            with self._news:  # started cold instead: a late fork must not run beside it
                if (reply := self._replies.pop(number, None)) is None:
                    self._abandoned.add(number)
            if reply is not None and "pid" in reply:
                _kill(int(reply["pid"]))
            reply = None
        if reply is None or "pid" not in reply:
            log.warning("agent_fork_failed", error=(reply or {}).get("error", "no reply"))
            return None
        return ForkedAgent(int(reply["pid"]), self)

    def _wait_ready(self) -> dict[str, Any] | None:
        """The launcher's ready message; None (said once) when it cannot fork."""
        ready = self._wait(lambda: self._ready, READY_TIMEOUT_S)
        with self._news:
            if ready is None:
                exited = self._closed
                ready = self._ready = self._ready or {
                    "error": "it exited" if exited else f"not ready in {READY_TIMEOUT_S} s"
                }
            if "error" not in ready:
                return ready
            if not ready.get("said"):
                ready["said"] = True
                log.warning("agent_forks_unavailable", reason=ready["error"], fallback="cold")
        return None

    def _wait(self, take: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        with self._news:
            while (value := take()) is None and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._news.wait(left)
            return value

    def exit_code(self, pid: int) -> int | None:
        """``pid``'s exit code once the launcher reaped it; None while it runs."""
        with self._news:
            if pid in self._exits:
                return self._exits[pid]
            if not self._closed:
                return None
        # The launcher is gone: its orphans are reaped by someone else now.
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return None
        except psutil.NoSuchProcess:
            pass
        return UNKNOWN_EXIT

    def wait_for_news(self, timeout: float) -> None:
        """Until the launcher says something, or ``timeout``."""
        with self._news:
            if not self._closed:
                self._news.wait(timeout)
                return
        time.sleep(timeout)  # nobody reports any more: exit_code polls the process

    def _read(self) -> None:
        try:
            while message := self._sock.recv(_MAX_MESSAGE):
                news = json.loads(message)
                with self._news:
                    if "ready" in news:
                        self._ready = news
                    elif int(news.get("request", -1)) in self._abandoned:
                        _kill(int(news.get("pid", -1)))
                    elif "request" in news:
                        self._replies[int(news["request"])] = news
                    elif "exit" in news:
                        self._exits[int(news["pid"])] = int(news["exit"])
                    self._news.notify_all()
        except OSError:
            pass
        finally:
            with self._news:
                self._closed = True
                self._news.notify_all()

    def close(self) -> None:
        """Stop the launcher; call once its agents are gone (it reports their exits)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._sock.close()
        self._reader.join(timeout=5)


def start_agent_forks(env: Mapping[str, str], log_dir: Path) -> AgentForks | None:
    """The run's launcher, logging to ``log_dir/agent-forks.log``; None where agents
    cannot be forked from it (not Linux, or it could not start): they start cold."""
    if sys.platform != "linux":  # SOCK_SEQPACKET pairs, fork without exec
        log.info("agent_forks_unavailable", reason=f"not on Linux ({sys.platform})")
        return None
    try:
        return AgentForks.start(env=env, log_path=log_dir / "agent-forks.log")
    except OSError as exc:
        log.warning("agent_forks_unavailable", reason=str(exc), fallback="cold")
        return None


def _kill(pid: int) -> None:
    if pid > 0:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# --- the launcher process -------------------------------------------------------------


def _preload() -> dict[str, Any]:
    """Import :data:`PRELOAD`; the ready message, or an error that makes every node cold."""
    # As started: torch's inductor sets TORCHINDUCTOR_CACHE_DIR while it imports.
    import_env = warm_start.import_time_environ(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    if (hazard := warm_start.fork_hazard()) is not None:
        return {"ready": True, "error": f"its imports {hazard}"}
    return {"ready": True, "import_env": import_env}


def _send(sock: socket.socket, message: Mapping[str, Any]) -> bool:
    """Whether the runner got ``message``; False once it is gone."""
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        return False
    return True


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork an agent per request and report every exit; in a fork, its request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        readable = select.select([sock, wake_r], [], [], 1.0)[0]
        if wake_r in readable:
            os.read(wake_r, 4096)
        if not _reap(sock):
            return None
        if sock not in readable:
            continue
        message = sock.recv(_MAX_MESSAGE)
        if not message:
            return None  # the runner is gone or done
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            _send(sock, {"request": request["request"], "error": str(exc)})
            continue
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            return request
        if not _send(sock, {"request": request["request"], "pid": pid}):
            return None


def _reap(sock: socket.socket) -> bool:
    """Report every child that ended; False once the runner is gone."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return True
        if not _send(sock, {"pid": pid, "exit": os.waitstatus_to_exitcode(status)}):
            return False


def _become_agent(request: Mapping[str, Any]) -> None:
    """In the fork: what ``Popen(start_new_session=True)`` and ``python -m`` would set up."""
    os.setsid()
    out = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out, 1), (out, 2)):
        os.dup2(fd, target)
    warm_start.close_descriptors_but(0, 1, 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # ps shows every fork with the launcher's command line: the name tells them apart.
    warm_start.set_process_name(f"et-agent:{os.environ.get('ELASTIC_TRAIN_NODE', '')}")
    module = request["module"]
    sys.argv = [module, *request["argv"]]
    sys.modules.pop(module, None)  # run as __main__ only, as -m runs it
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_train.local.agent_forks")
    parser.add_argument("--fd", type=int, required=True, help="the runner's socket")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    try:
        ready = _preload()
    except Exception as exc:  # an import that fails: every node starts cold
        ready = {"ready": True, "error": f"{type(exc).__name__}: {exc}"}
    if "error" in ready:
        _send(sock, ready)
        print(f"agent_forks: {ready['error']}; the nodes start cold", file=sys.stderr)
        return 1
    if not _send(sock, ready):
        return 0  # the runner is gone
    request = _serve(sock)
    if request is None:
        # The launcher holds nothing to finalize, and the teardown of what it imported
        # (torch, dynamo) took 2 s here, which the end of every run waited for.
        exit_now(0)
    sock.close()
    _become_agent(request)
    return 0


if __name__ == "__main__":
    sys.exit(main())
