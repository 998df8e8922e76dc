"""``elastic-train``: argument errors, and Ctrl-C on a real local cluster."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from elastic_train.agent.zygote import trainer_processes
from elastic_train.cli import EXIT_INTERRUPTED, EXIT_USAGE, main
from elastic_train.local import proctree
from elastic_train.local.cluster import port_is_free


def _no_run_started(run_dir: Path) -> bool:
    return not (run_dir / "logs").exists() or not any((run_dir / "logs").iterdir())


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--chaos", "kill:1@20s,boom:2@3s"], "'boom:2@3s'"),
        (["--chaos", "kill:1@soon"], "bad time 'soon'"),
        (["--chaos", "kill:7@5s"], "targets node 7"),
        (["--nodes", "0"], "nodes must be >= 1"),
        (["--training.stepz=5"], "training.stepz"),
        (["--training.steps=-1"], "training.steps"),
        (["--nodez", "3"], "'--nodez'"),
        (["--metrics-port", "99999"], "expected 0-65535 or 'off'"),
    ],
)
def test_bad_arguments_fail_before_anything_starts(
    args: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        code = main(["local", "--run-dir", str(tmp_path), "--quiet", *args])
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    assert code == EXIT_USAGE
    assert named in capsys.readouterr().err
    assert _no_run_started(tmp_path)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


@contextlib.contextmanager
def _taken_port_after_a_free_one() -> Iterator[int]:
    """A listening port whose predecessor is free now.

    Any loopback connection (etcd clients of earlier tests) may hold the port
    below an ephemeral one, so the predecessor is checked rather than assumed.
    """
    for _ in range(100):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            if port_is_free(port - 1):
                yield port
                return
    raise AssertionError("no listening port with a free port below it in 100 tries")


def test_a_metrics_port_in_use_is_named_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with _taken_port_after_a_free_one() as port:
        # Node 1 of a base port one below gets the taken port.
        code = main(
            ["local", "--quiet", "--run-dir", str(tmp_path), "--metrics-port", str(port - 1)]
        )
    assert code == EXIT_USAGE
    assert f"port {port} of node1 is in use" in capsys.readouterr().err
    assert _no_run_started(tmp_path)


def test_a_used_run_dir_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "audit").mkdir()
    (tmp_path / "audit" / "result.json").write_text("{}")
    assert main(["local", "--quiet", "--run-dir", str(tmp_path)]) == EXIT_USAGE
    assert f"run_dir {tmp_path} already holds a run" in capsys.readouterr().err
    assert _no_run_started(tmp_path)


def test_the_chaos_error_lists_the_accepted_forms(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["local", "--quiet", "--chaos", "kill1@20s"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "'kill1@20s'" in err and "KIND:NODE@SECONDSs" in err and "stepN" in err


def test_a_subcommand_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == EXIT_USAGE
    assert "local" in capsys.readouterr().err


def _run_processes(runner: psutil.Process, run_dir: Path) -> list[psutil.Process]:
    """The runner's descendants (etcd, agents, workers) and anything naming the run dir."""
    found = {p.pid: p for p in runner.children(recursive=True)}
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(run_dir) in arg for arg in proc.info["cmdline"] or ()):
            found.setdefault(proc.pid, proc)
    found.pop(runner.pid, None)
    return list(found.values())


@pytest.mark.slow
def test_ctrl_c_stops_every_process_of_the_run(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "elastic_train.cli", "local", "--nodes", "2", "--quiet",
        "--metrics-port", "0",
        "--run-dir", str(tmp_path), "--model.name=mlp", "--data.name=synthetic",
        "--training.steps=100000",
    ]  # fmt: skip
    # Helpers other tests left running (a forkserver and its resource tracker).
    earlier = {p.pid for p in psutil.Process().children(recursive=True)}
    # A terminal's foreground job gets Ctrl-C. pytest started as a background job
    # (`cmd &` in a script, CI) inherits SIGINT ignored, and so would the runner:
    # a handler here is reset to the default in the child (a disposition of
    # "ignore" would be inherited as it is).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        runner = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finally:
        signal.signal(signal.SIGINT, previous)
    procs: list[psutil.Process] = []
    try:
        audit = tmp_path / "audit"
        # Training is under way once both nodes' workers have recorded a step.
        deadline = time.monotonic() + 120
        while len({p.name.split("-")[1] for p in audit.glob("worker-*.jsonl")}) < 2:
            assert runner.poll() is None, runner.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no training within 120 s"
            time.sleep(0.1)
        procs = _run_processes(psutil.Process(runner.pid), tmp_path)
        # By the tree, not by command line: the agents are forked from one launcher,
        # the zygotes from their agent and the workers from a zygote, and all show
        # the launcher's.
        (launcher,) = [p for p in psutil.Process(runner.pid).children()
                       if "elastic_train.local.agent_forks" in p.cmdline()]  # fmt: skip
        agents = launcher.children()
        assert len(agents) == 2
        assert len([t for a in agents for t in trainer_processes(a)]) == 2
        assert sum("etcd" in p.name() for p in procs) == 1
        runner.send_signal(signal.SIGINT)
        _, err = runner.communicate(timeout=60)
    finally:
        if runner.poll() is None:  # its nodes too: left running, they would load later tests
            for proc in [psutil.Process(runner.pid), *procs]:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            runner.wait()
    assert runner.returncode == EXIT_INTERRUPTED, err[-3000:]
    assert proctree.alive(procs) == []
    leftovers = [p for p in _run_processes(psutil.Process(), tmp_path) if p.pid not in earlier]
    assert proctree.alive(leftovers) == []
    # What was audited up to the interruption is still summarized.
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["error"] == "interrupted" and not summary["completed"]
    assert summary["nodes"].keys() == {"node0", "node1"}
