"""The zygote forked from the torchrun agent itself (``zygote.fork_early``): real processes.

A stand-in agent imports what torchrun has imported when it creates the
rendezvous handler, forks its zygote, releases it with its workers'
environment, and serves a real worker through it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from test_warm_start import MAIN, _env, _events, _launch, assert_same_final_params

from elastic_train.agent.zygote import ZYGOTE_NAME

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the zygote is Linux only")

#: argv[1]: "plain", "thread" (a thread runs when the agent forks), "changed" (the
#: agent changes an import-time variable after the fork), "usr1-ignored" (started
#: as deploy/slurm/train.sbatch starts torchrun) or "cuda-refused" (torch refuses
#: CUDA in a fork of the agent, as a CUDA build of torch does under torchrun);
#: argv[2]: a file it keeps open.
AGENT = """
import json, os, signal, sys, threading, time
import torch, torch.distributed.run  # what torchrun has imported when it creates the handler
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig
from elastic_train.agent import zygote as zygote_module
from elastic_train.agent.zygote import fork_early
mode, kept = sys.argv[1], open(sys.argv[2])
# What torchrun does before it creates the handler; a CUDA build of torch asks the
# driver for its devices here, and refuses CUDA in every fork of this process after.
# (A log_dir: by default the specs make a torchelastic_* directory in /tmp for good.)
logs = DefaultLogsSpecs(log_dir=os.path.join(os.path.dirname(sys.argv[2]), "torchelastic"))
LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, logs_specs=logs)
if mode == "cuda-refused":  # the CPU build's answer, overridden: what a CUDA build says
    zygote_module._cuda_refused_here = lambda: True
if mode == "thread":
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
signal.signal(signal.SIGUSR2, lambda *_: None)  # a handler of the agent's: not the zygote's
zygote = fork_early(None, ["torchrun", MAIN])
print(json.dumps({"zygote": zygote and zygote.pid}), flush=True)
if zygote is not None:
    env = dict(os.environ, OMP_NUM_THREADS="3") if mode == "changed" else os.environ
    zygote.release(env)
    print(json.dumps({"socket": str(zygote.socket_path)}), flush=True)
    sys.stdin.readline()  # until the test is done
    zygote.close()
"""


@pytest.fixture
def agent(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[subprocess.Popen, dict]]:
    kept = tmp_path / "agents-file"
    kept.write_text("")
    python = [sys.executable, "-c", AGENT.replace("MAIN", repr(str(MAIN)))]
    if request.param == "usr1-ignored":  # an ignored signal stays ignored across exec
        python = ["bash", "-c", 'trap "" USR1; exec "$@"', "bash", *python]
    proc = subprocess.Popen(
        [*python, request.param, str(kept)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env(None),  # a launcher's environment, as an agent's zygote has it
    )  # fmt: skip
    assert proc.stdout is not None
    facts = json.loads(proc.stdout.readline() or "{}")
    if facts.get("zygote"):
        facts |= json.loads(proc.stdout.readline())
    facts["kept"] = str(kept)
    try:
        yield proc, facts
    finally:
        proc.kill()
        proc.wait()


def _ignored(pid: int) -> set[signal.Signals]:
    """The signals ``pid`` ignores (the ``SigIgn`` mask of /proc/PID/status)."""
    (line,) = [x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
               if x.startswith("SigIgn:")]  # fmt: skip
    mask = int(line.split()[1], 16)
    return {sig for sig in signal.Signals if mask >> (sig - 1) & 1}


def _named_zygote(pid: int) -> psutil.Process:
    """The forked child once it calls itself the zygote (its first act)."""
    zygote, deadline = psutil.Process(pid), time.monotonic() + 30
    while zygote.name() != ZYGOTE_NAME:
        assert time.monotonic() < deadline, zygote.name()
        time.sleep(0.01)
    return zygote


def _booted(zygote: psutil.Process) -> bool:
    """Whether the zygote runs a fresh interpreter (``python -c _BOOT``), not the agent's."""
    return "from elastic_train.agent.zygote import main" in " ".join(zygote.cmdline())


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["plain", "cuda-refused"], indirect=True)
def test_a_zygote_forked_from_the_agent_holds_nothing_of_it_and_trains_like_a_cold_start(
    agent: tuple[subprocess.Popen, dict], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Where torch would refuse CUDA in the fork ("cuda-refused"), the forked zygote
    execs a fresh interpreter in place: same process, same socket, workers still warm.
    Before it did, every worker forked on an H200 failed with "Cannot re-initialize
    CUDA in forked subprocess" (2026-11-29, docs/warm-start.md)."""
    proc, facts = agent
    zygote = _named_zygote(facts["zygote"])
    if request.node.callspec.params["agent"] == "cuda-refused":
        assert _booted(zygote), zygote.cmdline()
    assert zygote.ppid() == proc.pid
    assert zygote.pid != proc.pid and os.getsid(zygote.pid) == zygote.pid  # its own session
    assert facts["kept"] not in [f.path for f in zygote.open_files()]
    # The agent's SIGUSR2 handler is gone, as across an exec; nothing is ignored.
    assert signal.SIGUSR1 not in _ignored(zygote.pid)
    assert signal.SIGUSR2 not in _ignored(zygote.pid)
    warm = _launch(facts["socket"], tmp_path / "warm", "training.steps=6")
    cold = _launch(None, tmp_path / "cold", "training.steps=6")
    assert (warm.wait(120), cold.wait(120)) == (0, 0)
    (forked,) = _events(tmp_path / "warm.err", "warm_start_forked")
    assert forked["launcher_pid"] == warm.pid
    # The child that trained is the forked zygote's, not the launcher.
    (trainer_file,) = (tmp_path / "warm" / "audit").glob("worker-*.jsonl")
    assert trainer_file.stem != f"worker-node0-{warm.pid}"
    assert_same_final_params(tmp_path / "warm", tmp_path / "cold")
    assert proc.poll() is None, "the agent itself must go on"


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["usr1-ignored"], indirect=True)
def test_a_forked_zygote_ignores_what_its_agent_ignores_and_survives_slurms_signal(
    agent: tuple[subprocess.Popen, dict], tmp_path: Path
) -> None:
    """Slurm's ``--signal=USR1@90`` reaches every process of the step, the zygote
    included: it must outlive the notice and serve the next worker warm."""
    proc, facts = agent
    zygote = _named_zygote(facts["zygote"])
    assert signal.SIGUSR1 in _ignored(proc.pid)
    assert signal.SIGUSR1 in _ignored(zygote.pid)
    zygote.send_signal(signal.SIGUSR1)
    worker = _launch(facts["socket"], tmp_path / "run", "training.steps=2")
    assert worker.wait(120) == 0
    assert _events(tmp_path / "run.err", "warm_start_forked"), "the zygote died of SIGUSR1"
    assert zygote.status() != psutil.STATUS_ZOMBIE


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["changed"], indirect=True)
def test_a_zygote_whose_agent_changed_an_import_time_variable_exits_and_workers_start_cold(
    agent: tuple[subprocess.Popen, dict], tmp_path: Path
) -> None:
    """torch was imported here under the agent's old OMP_NUM_THREADS: no worker may
    be forked from it, and the agent goes on."""
    proc, facts = agent
    zygote, deadline = psutil.Process(facts["zygote"]), time.monotonic() + 60
    # A zombie until the agent reaps it; the agent reads its stdin meanwhile.
    while zygote.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the zygote still runs"
        time.sleep(0.02)
    assert proc.poll() is None
    worker = _launch(facts["socket"], tmp_path / "run", "training.steps=2")
    assert worker.wait(120) == 0
    assert not _events(tmp_path / "run.err", "warm_start_forked")
    assert _events(tmp_path / "run.err", "warm_start_unavailable")
    proc.stdin.close()
    assert proc.wait(30) == 0
    assert "the agent changed ['OMP_NUM_THREADS'] after torch was imported" in proc.stderr.read()


@pytest.mark.parametrize("agent", ["thread"], indirect=True)
def test_an_agent_with_a_thread_forks_no_zygote(agent: tuple[subprocess.Popen, dict]) -> None:
    """A fork keeps only the calling thread: the node agent spawns a zygote instead."""
    proc, facts = agent
    assert facts["zygote"] is None
    assert proc.wait(30) == 0
