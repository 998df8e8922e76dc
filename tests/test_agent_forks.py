"""Agents forked from one launcher (``elastic_train.local.agent_forks``), with real processes.

The launcher imports torch once and forks each node's agent. A fork must be
what ``Popen([python, -m, module, ...], start_new_session=True)`` would have
started, and the runner must learn how it ended, through the launcher. The
module run here is ``tests/fork_probe.py``, which reports what it finds; the
local runs of the other tests run torchrun's agent this way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_local import wait_for

from elastic_train.local.agent_forks import UNKNOWN_EXIT, AgentForks, ForkedAgent

PROBE = "tests.fork_probe"
PROBE_FILE = str(Path(__file__).with_name("fork_probe.py"))


@pytest.fixture(scope="module")
def forks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentForks]:
    log_dir = tmp_path_factory.mktemp("forks")
    launcher = AgentForks.start(env=dict(os.environ), log_path=log_dir / "launcher.log")
    yield launcher
    launcher.close()


def _fork(forks: AgentForks, log_path: Path, action: str) -> ForkedAgent:
    env = {**os.environ, "FORK_PROBE": "yes", "ELASTIC_TRAIN_NODE": "node7"}
    agent = forks.fork([action, "second"], env=env, log_path=log_path, module=PROBE)
    assert agent is not None, "the launcher refused the fork"
    return agent


def _report(log_path: Path) -> dict:
    wait_for(lambda: log_path.is_file() and log_path.read_text().endswith("\n"), timeout=60,
             what="the probe's report")  # fmt: skip
    return json.loads(log_path.read_text().splitlines()[0])


def test_a_fork_starts_like_python_dash_m_and_its_exit_code_comes_back(
    forks: AgentForks, tmp_path: Path
) -> None:
    log_path = tmp_path / "agent.log"
    agent = _fork(forks, log_path, "exit:3")
    assert agent.wait(timeout=60) == 3 and agent.returncode == 3
    report = _report(log_path)
    assert report["pid"] == agent.pid
    assert report["argv"] == [PROBE_FILE, "exit:3", "second"]  # as -m sets argv[0]
    assert report["probe"] == "yes" and report["cwd"] == os.getcwd()
    assert report["session_leader"] and report["stdin_is_devnull"]
    assert report["name"] == "et-agent:node7"  # what ps -o comm shows; argv is the launcher's
    # What it saves: torch was imported before the module ran, by the launcher.
    assert report["torch_imported"] and report["threads"] == 1


def test_a_signal_ends_a_fork_and_comes_back_as_popen_says_it(
    forks: AgentForks, tmp_path: Path
) -> None:
    waiting = _fork(forks, tmp_path / "waiting.log", "wait")
    _report(tmp_path / "waiting.log")
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(timeout=0.2)
    assert waiting.poll() is None
    waiting.send_signal(signal.SIGTERM)
    assert waiting.wait(timeout=60) == -signal.SIGTERM
    killed = _fork(forks, tmp_path / "killed.log", "kill")
    assert killed.wait(timeout=60) == -signal.SIGKILL
    killed.send_signal(signal.SIGTERM)  # ended: no signal to a pid that may be reused


def test_a_node_whose_import_time_environment_differs_is_not_forked(
    forks: AgentForks, tmp_path: Path
) -> None:
    # The launcher imported torch under its own OpenMP settings: a fork would keep them.
    threads = str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1)
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    log_path = tmp_path / "agent.log"
    assert forks.fork(["exit:0"], env=env, log_path=log_path, module=PROBE) is None
    assert not log_path.exists()


def test_a_fork_outlives_its_launcher_and_its_end_is_still_seen(tmp_path: Path) -> None:
    forks = AgentForks.start(env=dict(os.environ), log_path=tmp_path / "launcher.log")
    try:
        agent = _fork(forks, tmp_path / "agent.log", "wait")
        _report(tmp_path / "agent.log")
        os.kill(forks.pid, signal.SIGKILL)
        wait_for(lambda: not forks.running, timeout=30, what="the launcher's end")
        assert agent.poll() is None  # still running, orphaned
        os.kill(agent.pid, signal.SIGKILL)
        # Its parent is gone: the status is unknown, but the end is seen.
        assert agent.wait(timeout=60) == UNKNOWN_EXIT
    finally:
        forks.close()


def test_without_a_launcher_nothing_is_forked_and_the_node_starts_cold(tmp_path: Path) -> None:
    forks = AgentForks.start(env=dict(os.environ), log_path=tmp_path / "launcher.log")
    try:
        os.kill(forks.pid, signal.SIGKILL)  # before or while it imports
        log_path = tmp_path / "agent.log"
        assert forks.fork(["exit:0"], env=dict(os.environ), log_path=log_path, module=PROBE) is None
        assert not forks.running and not log_path.exists()
    finally:
        forks.close()
