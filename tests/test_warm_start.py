"""Warm worker start: a real zygote forks real trainers; real signals; real torchrun agents."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from steered_runs import JOIN_WAIT_S, Pace, run_steered
from torch.distributed.elastic.rendezvous import RendezvousParameters
from trainer_procs import TINY_JOB

from elastic_train.agent import node_agent
from elastic_train.agent.warm_start import SOCKET_ENV, interpreter_fingerprint, launcher_name
from elastic_train.agent.worker_entry import WorkerEntry
from elastic_train.agent.zygote import (
    EXIT_UNSAFE_PRELOAD,
    SOCKET_NAME,
    ZYGOTE_NAME,
    ZygoteProcess,
    _remove_stale_directories,
    trainer_processes,
)
from elastic_train.audit import AuditTail
from elastic_train.errors import EXIT_CONFIG_ERROR, ConfigError
from elastic_train.local import proctree
from elastic_train.torchrun_plugin import check_rdzv_conf

REPO = Path(__file__).resolve().parents[1]
MAIN = REPO / "elastic_train" / "main.py"
#: 0.1 s steps: after the join trigger (step 12) the joiner has 6 s or more to start
#: its zygote and join, even when node0's restart waits for a replaced zygote
E2E_STEPS = 72
#: steps of 0.05 s at least, so a signal lands mid-run on any machine
PACED = ("model.name=tests.paced_model:paced_mlp", "model.options.seconds=0.05")


def _params(**conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd-v3", endpoint="127.0.0.1:2379", run_id="r", min_nodes=1, max_nodes=2, **conf
    )


def test_warm_start_key_is_parsed_like_the_other_node_agent_keys() -> None:
    assert "warm_start" in node_agent.RDZV_CONF_KEYS
    check_rdzv_conf(_params(warm_start="0"))  # the backend accepts the key

    def setting(params: RendezvousParameters, environ: dict[str, str]) -> bool | None:
        return node_agent.AgentSettings.from_params(params, environ).warm_start

    assert setting(_params(), {}) is None  # auto
    assert setting(_params(warm_start="auto"), {}) is None
    assert setting(_params(warm_start="0"), {}) is False
    assert setting(_params(), {"ELASTIC_TRAIN_WARM_START": "off"}) is False
    # The rdzv-conf key wins over the environment, as for every node_agent key.
    assert setting(_params(warm_start="1"), {"ELASTIC_TRAIN_WARM_START": "0"}) is True
    with pytest.raises(ConfigError, match=r"warm_start='maybe'.*expected one of 1, 0, true"):
        setting(_params(warm_start="maybe"), {})


def test_the_worker_entry_comes_from_the_torchrun_command() -> None:
    own = REPO / "tests/scripts/ddp_minimal.py"
    entry = WorkerEntry.from_torchrun_argv
    assert entry(["torchrun", "--nnodes=1:2", str(MAIN), "--x=1"]) == WorkerEntry(str(MAIN))
    assert entry(["/x/torch/distributed/run.py", "-m", "elastic_train.main"]) == WorkerEntry(
        "elastic_train.main", is_module=True
    )
    assert entry(["torchrun", "--no-python", "echo", "hi"]) is None
    assert entry(sys.argv) is None  # a process that creates handlers itself
    assert entry(["torchrun", "-m", "elastic_train.main"]).file() == str(MAIN.resolve())
    assert entry(["torchrun", str(own)]).file() == str(own.resolve())
    # auto: a zygote for our trainer only; warm_start=1 for any Python entry.
    auto, forced = node_agent.AgentSettings(), node_agent.AgentSettings(warm_start=True)
    linux = sys.platform == "linux"
    assert (auto.zygote_entry(["torchrun", str(MAIN)]) is not None) is linux
    assert auto.zygote_entry(["torchrun", str(own)]) is None
    assert forced.zygote_entry(["torchrun", str(own)]) == (WorkerEntry(str(own)) if linux else None)
    assert node_agent.AgentSettings(warm_start=False).zygote_entry(["torchrun", str(MAIN)]) is None


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZygoteProcess]:
    proc = ZygoteProcess(
        WorkerEntry(str(MAIN)), parent_dir=tmp_path_factory.mktemp("zygote"), environ=_env(None)
    )
    yield proc
    proc.close()
    assert not proc.directory.exists()


@pytest.fixture
def socket_parent() -> Iterator[Path]:
    """A short directory for a zygote's socket: an AF_UNIX path holds at most 107
    bytes, and ``tmp_path`` under ``pytest -n`` (xdist) is longer than that allows."""
    directory = Path(tempfile.mkdtemp(prefix="et-test-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _env(socket_path: Path | str | None) -> dict[str, str]:
    """A worker's environment; the zygote gets the same, less the socket (as from an agent)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))}
    env |= {"OMP_NUM_THREADS": "1", "ELASTIC_TRAIN_NODE": "node0"}
    env.pop(SOCKET_ENV, None)
    if socket_path is not None:
        env[SOCKET_ENV] = str(socket_path)
    return env


def _launch(
    socket_path: Path | str | None, run: Path, *overrides: str, **extra_env: str
) -> subprocess.Popen[str]:
    """main.py as torchrun starts it (``python -u``), with the node agent's socket variable."""
    args = [f"--{o}" for o in (*TINY_JOB, *overrides)]
    args += [f"--checkpoint.dir={run / 'ckpt'}", f"--logging.audit_dir={run / 'audit'}"]
    with open(run.with_suffix(".err"), "w") as err:
        return subprocess.Popen(
            [sys.executable, "-u", str(MAIN), *args],
            env=_env(socket_path) | extra_env,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
        )


def _events(path: Path, name: str) -> list[dict]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("{")]
    return [e for e in map(json.loads, lines) if e.get("event") == name]


def _warm_child(zygote: ZygoteProcess, launcher: subprocess.Popen[str]) -> psutil.Process:
    """The zygote's child that trains for ``launcher`` (polled: the launcher names it)."""
    return _warm_child_of(zygote.pid, launcher)


def _warm_child_of(zygote_pid: int, launcher: subprocess.Popen[str]) -> psutil.Process:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert launcher.poll() is None, "the launcher exited before its child was forked"
        for proc in trainer_processes(psutil.Process()):
            if proc.ppid() == zygote_pid:
                assert psutil.Process(launcher.pid).name() == launcher_name(proc.pid)
                return proc
        time.sleep(0.05)
    raise AssertionError("no warm child within 60 s")


def _wait_for_step(audit: Path, step: int, proc: subprocess.Popen[str]) -> int:
    tail, deadline = AuditTail(audit), time.monotonic() + 60
    while time.monotonic() < deadline:
        steps = [getattr(r, "step", 0) for r in tail.poll()]
        if steps and max(steps) >= step:
            return max(steps)
        assert proc.poll() is None, "the worker exited early"
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within 60 s")


@pytest.mark.slow
def test_preload_starts_no_thread_and_leaves_cuda_alone() -> None:
    # A CUDA build of torch refuses CUDA in a fork of a process that asked the driver
    # anything (torch.cuda.is_available() is enough): the child reports that.
    code = (
        "import json, os, sys, threading, torch\n"
        "from elastic_train.agent.zygote import preload\n"
        "preload()\n"
        "facts = {'threads': threading.active_count(),\n"
        "    'cuda': torch.cuda.is_initialized(), 'dynamo': 'torch._dynamo' in sys.modules,\n"
        "    'trainer': 'elastic_train.training.loop' in sys.modules}\n"
        "if os.fork() == 0:\n"
        "    facts['child_refused_cuda'] = torch.cuda._is_in_bad_fork()\n"
        "    print(json.dumps(facts), flush=True)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    facts = json.loads(out.stdout)
    assert facts == {"threads": 1, "cuda": False, "dynamo": True, "trainer": True,
                     "child_refused_cuda": False}  # fmt: skip


@pytest.mark.slow
def test_a_forked_worker_trains_exactly_like_a_cold_start(
    zygote: ZygoteProcess, tmp_path: Path
) -> None:
    """The same job warm and cold (the fallback for a dead socket): the same parameters."""
    warm = _launch(zygote.socket_path, tmp_path / "warm", "training.steps=6")
    dead = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stale:
        stale.bind(str(dead))  # a socket file nobody listens on: connection refused
    cold = _launch(dead, tmp_path / "cold", "training.steps=6")
    assert (warm.wait(120), cold.wait(120)) == (0, 0)
    (forked,) = _events(tmp_path / "warm.err", "warm_start_forked")
    assert forked["launcher_pid"] == warm.pid
    (trainer_file,) = (tmp_path / "warm" / "audit").glob("worker-*.jsonl")
    assert trainer_file.stem != f"worker-node0-{warm.pid}"  # the zygote's child trained
    (fallback,) = _events(tmp_path / "cold.err", "warm_start_unavailable")
    assert "ConnectionRefusedError" in fallback["reason"]
    assert not _events(tmp_path / "cold.err", "warm_start_forked")
    assert_same_final_params(tmp_path / "warm", tmp_path / "cold")


def assert_same_final_params(warm: Path, cold: Path) -> None:
    params = [
        torch.load(run / "audit" / "final_params.pt", weights_only=True) for run in (warm, cold)
    ]
    assert params[0].keys() == params[1].keys()
    for name in params[0]:
        assert torch.equal(params[0][name], params[1][name]), name


@pytest.mark.slow
def test_the_launcher_exits_with_the_childs_code_or_signal(
    zygote: ZygoteProcess, tmp_path: Path
) -> None:
    bad = _launch(zygote.socket_path, tmp_path / "bad", "training.global_batch_size=0")
    assert bad.wait(60) == EXIT_CONFIG_ERROR
    assert _events(tmp_path / "bad.err", "warm_start_forked")
    # An exception: torchrun's @record error file, written by the child, names it.
    error_file = tmp_path / "error.json"
    crash = _launch(
        zygote.socket_path, tmp_path / "crash", "model.name=tests.paced_model:paced_mlp",
        "model.options.seconds=abc", TORCHELASTIC_ERROR_FILE=str(error_file),
    )  # fmt: skip
    assert crash.wait(60) == 1
    assert _events(tmp_path / "crash.err", "warm_start_forked")
    message = json.loads(error_file.read_text())["message"]["message"]
    assert "could not convert string to float: 'abc'" in message
    long = _launch(zygote.socket_path, tmp_path / "long", *PACED, "training.steps=100000")
    child = _warm_child(zygote, long)
    child.kill()
    assert long.wait(30) == -signal.SIGKILL


@pytest.mark.slow
def test_a_child_that_cannot_take_over_sends_its_launcher_back_to_a_cold_start(
    zygote: ZygoteProcess, tmp_path: Path
) -> None:
    """The child fails before running anything of the worker (here: a variable the
    OS refuses): the launcher hears why, not an exit code, and starts cold."""
    request = {
        "main_file": os.path.realpath(MAIN), "argv": [str(MAIN)], "cwd": str(tmp_path),
        "env": {**_env(None), "NOT_AN_ENV_VALUE": "a\0b"}, "path": sys.path,
        "unbuffered": True, "interpreter": interpreter_fingerprint(), "launcher_pid": 1,
        "sent_at": time.time(),
    }  # fmt: skip
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn, open(os.devnull) as null:
        conn.settimeout(60)
        conn.connect(str(zygote.socket_path))
        socket.send_fds(conn, [json.dumps(request).encode()], [null.fileno()] * 3)
        assert "pid" in json.loads(conn.recv(65536))
        assert "embedded null byte" in json.loads(conn.recv(65536))["fallback"]
        assert os.waitstatus_to_exitcode(json.loads(conn.recv(65536))["status"]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_to_the_launcher_preempts_the_child_with_no_lost_step(
    zygote: ZygoteProcess, tmp_path: Path, sig: signal.Signals
) -> None:
    run = tmp_path / "run"
    launcher = _launch(
        zygote.socket_path, run, *PACED, "training.steps=100000",
        "checkpoint.interval_steps=100000", "logging.level=INFO",
    )  # fmt: skip
    _wait_for_step(run / "audit", 3, launcher)
    launcher.send_signal(sig)
    assert launcher.wait(60) == 0, (tmp_path / "run.err").read_text()[-3000:]
    (stop,) = _events(tmp_path / "run.err", "worker_exit_after_preemption")
    assert stop["reason"] == "preempted"
    tail = AuditTail(run / "audit")
    last = max(getattr(r, "step", 0) for r in tail.poll())
    saved = [int(p.parent.name.split("-")[1]) for p in (run / "ckpt").glob("step-*/MANIFEST.json")]
    assert saved == [last]  # the last completed step is on disk


@pytest.mark.slow
def test_a_worker_outlives_its_zygote_and_still_reports_its_exit_code(
    tmp_path: Path, socket_parent: Path
) -> None:
    """The zygote dies (a crash, the OOM killer): its children train on, and a
    launcher exits with the code its child reported, here 0 after a preemption."""
    own = ZygoteProcess(WorkerEntry(str(MAIN)), parent_dir=socket_parent, environ=_env(None))
    try:
        run = tmp_path / "run"
        launcher = _launch(own.socket_path, run, *PACED, "training.steps=100000")
        _warm_child(own, launcher)
        own.proc.kill()
        own.proc.wait()
        step = _wait_for_step(run / "audit", 1, launcher)
        _wait_for_step(run / "audit", step + 2, launcher)  # trains on without the zygote
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0, (tmp_path / "run.err").read_text()[-3000:]
    finally:
        own.close()


@pytest.mark.slow
@pytest.mark.parametrize("stopped", [False, True], ids=["running", "sigstopped"])
def test_a_killed_launcher_takes_its_child_along(
    zygote: ZygoteProcess, tmp_path: Path, stopped: bool
) -> None:
    """No orphan trains on: the child watches its launcher, and the zygote reaches
    a child that cannot watch (stopped, or stuck holding the GIL)."""
    launcher = _launch(zygote.socket_path, tmp_path / "run", *PACED, "training.steps=100000")
    child = _warm_child(zygote, launcher)
    _wait_for_step(tmp_path / "run" / "audit", 1, launcher)
    if stopped:
        child.suspend()
    killed = time.monotonic()
    launcher.kill()
    launcher.wait()
    _, alive = psutil.wait_procs([child], timeout=5)
    assert not alive, f"the child outlived its launcher by 5 s (stopped={stopped})"
    print(f"child gone {time.monotonic() - killed:.3f}s after its launcher's SIGKILL")


def _parent_of_a_zygote(parent_dir: Path, *, wait_ready: bool) -> tuple[subprocess.Popen, dict]:
    """A process that starts a zygote (as the agent does), says where, then idles."""
    code = (
        "import json, socket, sys, time\n"
        "from pathlib import Path\n"
        "from elastic_train.agent.zygote import ZygoteProcess\n"
        "from elastic_train.agent.worker_entry import WorkerEntry\n"
        f"z = ZygoteProcess(WorkerEntry({str(MAIN)!r}), parent_dir=Path({str(parent_dir)!r}))\n"
        f"if {wait_ready}:\n"  # an empty request is declined, once the zygote serves
        "    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:\n"
        "        s.connect(str(z.socket_path)); s.send(b'{}'); s.recv(4096)\n"
        "print(json.dumps({'pid': z.pid, 'dir': str(z.directory)}), flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen(  # a launcher's environment, as an agent's zygote has it
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_env(None)
    )
    assert parent.stdout is not None
    return parent, json.loads(parent.stdout.readline())


@pytest.mark.slow
def test_the_zygote_dies_with_its_parent(zygote: ZygoteProcess, socket_parent: Path) -> None:
    """While importing (PR_SET_PDEATHSIG) and while serving (its stdin pipe closes,
    and it removes its socket directory). The next zygote removes what one
    killed while importing left, and nothing of a live one."""
    directories = []
    for wait_ready in (False, True):
        parent, started = _parent_of_a_zygote(socket_parent, wait_ready=wait_ready)
        try:
            proc = psutil.Process(started["pid"])
            parent.kill()
            parent.wait()
            _, alive = psutil.wait_procs([proc], timeout=5)
            assert not alive, f"the zygote outlived its parent (ready={wait_ready})"
        finally:
            parent.kill()
        directories.append(Path(started["dir"]))
        left = Path(started["dir"]) / SOCKET_NAME
        if left.exists():  # killed while importing: left behind for the next zygote
            # Only a socket older than a minute is taken for stale (the sweep
            # reads the kernel's table before it lists the directories).
            os.utime(left, (time.time() - 3600,) * 2)
    # The second zygote's start removed the first's; the second removed its own.
    assert not any(d.exists() for d in directories)
    _remove_stale_directories(zygote.directory.parent)
    assert zygote.socket_path.is_socket()  # a live zygote's stays


@pytest.mark.slow
def test_a_zygote_whose_agent_dies_takes_its_children_along(
    tmp_path: Path, socket_parent: Path
) -> None:
    """Only the zygote's own duty: this launcher lives on (pytest started it, no agent
    PID to die with), yet the child that trains for it is SIGKILLed and reaped."""
    parent, started = _parent_of_a_zygote(socket_parent, wait_ready=True)
    socket_path = Path(started["dir"]) / SOCKET_NAME
    launcher = _launch(socket_path, tmp_path / "run", *PACED, "training.steps=100000")
    try:
        child = _warm_child_of(started["pid"], launcher)
        _wait_for_step(tmp_path / "run" / "audit", 1, launcher)
        procs = [child, psutil.Process(started["pid"])]
        killed = time.monotonic()
        parent.kill()
        parent.wait()
        # Polled: psutil's wait takes a zombie that init has not reaped yet for alive.
        while proctree.alive(procs) and time.monotonic() - killed < 5:
            time.sleep(0.005)
        assert not proctree.alive(procs), "the zygote or its child outlived its parent by 5 s"
        print(f"zygote and child gone {time.monotonic() - killed:.3f}s after its parent's SIGKILL")
        assert launcher.wait(30) == -signal.SIGKILL  # the status the zygote reaped
    finally:
        parent.kill()
        launcher.kill()
        launcher.wait()


@pytest.mark.slow
def test_two_torchrun_nodes_start_every_worker_warm_and_train_exactly_once(
    tmp_path: Path,
) -> None:
    """``elastic-train local`` (etcd backend, warm start by default): node1 is killed and
    joins again, and node0's zygote is killed once it forked node0's first worker.
    Every worker start of every node goes through a zygote (node0's agent replaces
    its dead one before the next round) and the data is still seen exactly once.
    The forwards pause 0.1 s, and from node1's kill until both nodes train again at
    least ``JOIN_WAIT_S`` (``steered_runs``): on a loaded machine a late rejoin still
    lands before the last step (at 0.1 s, node1's agent once took 7 s to start and
    the run ended first)."""
    run = tmp_path / "run"
    pace = Pace(tmp_path / "pause", 0.1)
    killed: list[psutil.Process] = []

    def kill_zygote() -> None:
        if not killed and (zygote := _forked_zygote(run, "node0")) is not None:
            zygote.kill()
            killed.append(zygote)

    command = [
        "--nodes", "2", "--chaos", "kill:1@step6,join:1@step12", "--run-dir", str(run),
        "--timeout", "150", "--metrics-port", "0", "--data.name=synthetic",
        "--data.num_samples=96", "--training.global_batch_size=16",
        f"--training.steps={E2E_STEPS}", "--checkpoint.interval_steps=4",
        "--model.name=tests.steered_model:steered", f"--model.options.pause_file={pace.path}",
        # node0's restarts are the zygote's work here (in process, node0 never restarts)
        "--elastic.recovery=restart",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
    summary = run_steered(run, command, pace=pace, nodes=2, env=env, on_tick=kill_zygote,
                          join_wait=JOIN_WAIT_S)  # fmt: skip
    assert killed, "node0's zygote never forked a worker"
    assert summary["completed"] and summary["final_step"] == E2E_STEPS, summary
    assert summary["exactly_once"], summary["exactly_once_detail"]
    assert [(r["kind"], r["world_size_after"]) for r in summary["recoveries"]] == [
        ("kill", 1),
        ("join", 2),
    ]
    logs = {p.stem: p for p in (run / "logs").glob("node*.log")}
    starts = {node: len(_events(path, "process_group_ready")) for node, path in logs.items()}
    forked = {node: len(_events(path, "warm_start_forked")) for node, path in logs.items()}
    # node0: at least the first start, the restart without node1, the restart with
    # it again; node1: its first start and its start after the join.
    assert starts == forked, (starts, forked)
    assert starts["node0"] >= 3 and starts["node1"] >= 2, starts
    assert not any(_events(path, "warm_start_unavailable") for path in logs.values())
    assert len(_events(logs["node0"], "warm_start_zygote_died")) == 1
    # Every agent forks its first zygote from itself; a replacement is a fresh interpreter.
    zygotes = {
        node: [e["forked_from_agent"] for e in _events(path, "warm_start_zygote_started")]
        for node, path in logs.items()
    }
    assert zygotes == {"node0": [True, False], "node1": [True, True]}, zygotes


def _forked_zygote(run: Path, node: str) -> psutil.Process | None:
    """A node's zygote once it forked the node's first worker; None before."""
    log = run / "logs" / f"{node}.log"
    if not (log.is_file() and _events(log, "warm_start_forked")):
        return None
    # By the pid its agent logged: a zygote forked from an agent that the run's
    # launcher forked shows the launcher's environment in /proc, not the node's.
    started = _events(log, "warm_start_zygote_started")
    with contextlib.suppress(psutil.NoSuchProcess):
        proc = psutil.Process(started[-1]["pid"])
        if proc.name() == ZYGOTE_NAME:
            return proc
    raise AssertionError(f"{node} forked a worker warm, but no zygote of it is running")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the zygote is Linux only")
@pytest.mark.parametrize("code", [0, 3])
def test_a_users_own_script_is_forked_warm_and_keeps_its_exit_code(
    etcd_endpoint: str, tmp_path: Path, code: int, rdzv_secret_file: Path
) -> None:
    """The zygote runs the entry of the torchrun command, not only our main.py."""
    script = REPO / "tests/scripts/own_warm_entry.py"
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
            "--max-restarts=0", "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={etcd_endpoint}",
            f"--rdzv-id=own-{code}-{os.getpid()}",
            f"--rdzv-conf=warm_start=1,metrics_port=0,secret_file={rdzv_secret_file}",
            str(script), str(tmp_path), str(code),
        ],
        env=_env(None), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert (proc.returncode == 0) is (code == 0), proc.stderr[-3000:]
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report == {"preloaded": True, "parent": ZYGOTE_NAME, "cuda_bad_fork": False}, report
    if code:
        assert f"exitcode  : {code}" in proc.stderr, proc.stderr[-3000:]


def test_preload_key_names_modules_and_refuses_anything_else() -> None:
    def preload(params: RendezvousParameters, environ: dict[str, str]) -> tuple[str, ...]:
        return node_agent.AgentSettings.from_params(params, environ).preload

    check_rdzv_conf(_params(preload="transformers"))  # the backend accepts the key
    assert preload(_params(), {}) == ()
    # '+' in rdzv-conf, which torchrun splits at commas; either in the variable
    assert preload(_params(preload="transformers+torchvision.models"), {}) == (
        "transformers", "torchvision.models",
    )  # fmt: skip
    assert preload(_params(), {"ELASTIC_TRAIN_PRELOAD": "a.b, c"}) == ("a.b", "c")
    assert preload(_params(preload="x"), {"ELASTIC_TRAIN_PRELOAD": "y"}) == ("x",)
    with pytest.raises(ConfigError, match=r"preload: 'torch/nn' is not a module name"):
        preload(_params(preload="transformers+torch/nn"), {})


def test_preloaded_modules_are_imported_once_in_the_zygote_not_in_each_worker(
    tmp_path: Path, socket_parent: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A model library named by ``preload`` costs its import once per zygote, not once
    per worker start (transformers: about 6 s here); a name that fails to import is
    left to the workers, which report it."""
    record = tmp_path / "imports"
    probe = {"PRELOAD_PROBE_FILE": str(record)}
    zygote = ZygoteProcess(
        WorkerEntry(str(MAIN)), parent_dir=socket_parent, environ=_env(None) | probe,
        preload=["tests.preload_probe", "no_such_module_here"],
    )  # fmt: skip
    try:
        run = tmp_path / "w"
        worker = _launch(zygote.socket_path, run, "model.name=tests.preload_probe:model", **probe)
        assert worker.wait(120) == 0
        assert _events(run.with_suffix(".err"), "warm_start_forked")
        # The worker built its model from the module without importing it again.
        assert record.read_text().split() == [str(zygote.pid)]
    finally:
        zygote.close()
    assert "preload 'no_such_module_here' failed: ModuleNotFoundError" in capfd.readouterr().err


def test_a_preload_that_starts_a_thread_ends_the_zygote_for_good(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A fork copies one thread only: a zygote that a preload gave a thread is not safe
    to fork from, so it exits, and its socket refuses launchers, which start cold
    (``test_a_forked_worker_trains_exactly_like_a_cold_start``). The agent does not
    replace it: the replacement would import the same and exit again, at every
    round. Its workers start cold from then on, without a socket that refuses them."""
    monkeypatch.setenv("PRELOAD_PROBE_THREAD", "1")
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    settings = node_agent.AgentSettings(warm_start=True, preload=("tests.preload_probe",))
    agent = node_agent.NodeAgent(settings, run_id="r", argv=["torchrun", str(MAIN)])
    agent._start_zygote()  # as at the agent's start
    assert agent.zygote is not None and os.environ[SOCKET_ENV]
    assert agent.zygote.proc.wait(120) == EXIT_UNSAFE_PRELOAD
    launcher = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with launcher, pytest.raises(ConnectionRefusedError):
        launcher.connect(os.environ[SOCKET_ENV])
    for _ in range(2):  # the next rounds
        agent._replace_dead_zygote()
        assert agent.zygote is None and SOCKET_ENV not in os.environ
    assert "left 2 threads; a fork of this process is not safe" in capfd.readouterr().err
