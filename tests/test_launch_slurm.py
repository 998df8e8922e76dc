"""Two copies of the Slurm script on one host: both train, each with its own locked-down etcd.

``deploy/slurm/train.sbatch`` runs for real, twice at once, with the stand-in
``srun`` of ``test_manifest_commands`` (one task per "node" on this machine),
both jobs' etcd on one address (127.0.0.2) as on a shared node. While they
train, each job's etcd is checked from outside: it listens on that address
only, on a port of its own; clients need a certificate of the job's own CA;
authentication is on and the job's user can touch only its own keys; the job
directory is private and no secret is on a command line.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from k8s_manifests import REPO_ROOT
from steered_runs import Pace
from test_manifest_commands import (
    DEADLINE_S,
    SBATCH,
    TINY,
    _result,
    _slurm_env,
    _start,
    _wait_all,
    _world_sizes,
    processes,
)

from elastic_train.etcd.server import find_etcd_binary
from elastic_train.local import proctree

__all__ = ["processes"]  # the fixture, shared with test_manifest_commands

#: the jobs' steps: each forward pauses PAUSE_S (tests/steered_model.py, a sleep:
#: no CPU) until the checks below are done, so both jobs still train then however
#: fast the machine (80 unpaced steps, about 6 s here, once ended before the checks);
#: the steps after the checks run unpaced
LONG_STEPS = 60
PAUSE_S = 1.0


def _job_processes(root: psutil.Process, name: str) -> list[psutil.Process]:
    """The processes of a job's tree whose command line names ``name`` (etcd, torchrun)."""
    found = []
    for proc in proctree.descendants(root):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            if any(Path(arg).name == name for arg in proc.cmdline()[:3]):
                found.append(proc)
    return found


def _etcdctl(endpoint: str, *args: str, tls: Path, cert: bool = True, refused: bool = False) -> str:
    """etcdctl against ``endpoint`` with the CA (and client certificate) of ``tls``.

    A connection expected to be ``refused`` gets 1 s to connect; others are given time
    enough for a machine busy with two jobs' trainings.
    """
    env = {**os.environ, "ETCDCTL_API": "3", "ETCDCTL_DIAL_TIMEOUT": "1s" if refused else "20s"}
    env["ETCDCTL_COMMAND_TIMEOUT"] = "3s" if refused else "30s"
    env.pop("ETCDCTL_USER", None)
    env["ETCDCTL_CACERT"] = str(tls / "ca.crt")
    if cert:
        env |= {"ETCDCTL_CERT": str(tls / "client.crt"), "ETCDCTL_KEY": str(tls / "client.key")}
    proc = subprocess.run(
        [str(Path(find_etcd_binary()).with_name("etcdctl")), f"--endpoints=https://{endpoint}",
         *args], env=env, capture_output=True, text=True, errors="replace", timeout=120,
        check=False,
    )  # fmt: skip
    return f"rc={proc.returncode} {proc.stdout} {proc.stderr}"


@dataclass(frozen=True)
class SlurmJobFacts:
    """What a running job made, read at once (the job deletes it all when it ends)."""

    job_id: str
    etcd: psutil.Process
    endpoint: str  # host:port its etcd listens on
    tls: Path  # a copy of its certificates
    hidden: set[str]  # the job secret and both passwords


def _job_facts(job_id: str, root: psutil.Process, jobs: Path, copies: Path) -> SlurmJobFacts:
    """The job directory: private, 0600 secrets; where its etcd listens; nothing secret
    on any command line of the job."""
    (etcd,) = _job_processes(root, "etcd")
    (url,) = [a.split("=", 1)[1] for a in etcd.cmdline() if a.startswith("--listen-client-urls=")]
    job_dir = jobs / f"slurm-{job_id}"
    assert job_dir.stat().st_mode & 0o777 == 0o700
    for name in ("rdzv-secret", "etcd-password", "etcd-root-password", "tls/client.key"):
        assert (job_dir / name).stat().st_mode & 0o777 == 0o600, name
    names = ("rdzv-secret", "etcd-password", "etcd-root-password")
    hidden = {(job_dir / name).read_text().strip() for name in names}
    assert all(re.fullmatch(r"[0-9a-f]{64}", value) for value in hidden) and len(hidden) == 3
    tls = shutil.copytree(job_dir / "tls", copies / f"tls-{job_id}")
    for proc in [root, *proctree.descendants(root)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            words = set(" ".join(proc.cmdline()).replace(",", " ").split())
            assert not hidden & words, f"a secret on the command line of {proc.name()}"
    return SlurmJobFacts(job_id, etcd, url.removeprefix("https://"), Path(tls), hidden)


def _check_etcd(job: SlurmJobFacts, other: SlurmJobFacts) -> None:
    """Only on the given address; TLS client certificates of the job's own CA; auth on,
    with a user limited to this job's keys."""
    host, port = job.endpoint.rsplit(":", 1)
    assert host == "127.0.0.2", job.endpoint
    # Not 0.0.0.0: etcd listens on this port on the given address only. (Asked of etcd's
    # own sockets: a bind test on 127.0.0.1 failed once in CI on another process's
    # ephemeral port of the same number.)
    listening = {c.laddr.ip for c in job.etcd.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == int(port)}  # fmt: skip
    assert listening == {"127.0.0.2"}, f"etcd listens on {listening} port {port}"
    # Random passwords: every login (each worker's again after a quiet spell, at a
    # recovery) costs etcd about 1 ms at the lowest cost, 66 ms at the default.
    assert "--bcrypt-cost=4" in job.etcd.cmdline()
    mine, theirs = f"/elastic-train/slurm-{job.job_id}/", f"/elastic-train/slurm-{other.job_id}/"
    no_cert = _etcdctl(job.endpoint, "get", mine, tls=job.tls, cert=False, refused=True)
    assert not no_cert.startswith("rc=0"), no_cert
    foreign = _etcdctl(job.endpoint, "get", mine, tls=other.tls, refused=True)
    assert not foreign.startswith("rc=0"), foreign
    # The rendezvous user (the client certificate's CN) reads this job's keys, nothing else.
    # Asked last: the refusals above were not just an etcd that had gone.
    denied = _etcdctl(job.endpoint, "put", f"{theirs}state", "x", tls=job.tls)
    assert "permission denied" in denied, denied
    own = _etcdctl(job.endpoint, "get", "--prefix", "--keys-only", mine, tls=job.tls)
    assert own.startswith("rc=0"), own


@pytest.mark.slow
def test_two_slurm_jobs_on_one_host_both_train_with_their_own_locked_down_etcd(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    jobs, logs, audits = ("5001", "5002"), [], []
    pace = Pace(tmp_path / "pause", PAUSE_S)
    # The default model (char_transformer), steered: the workers import tests.steered_model.
    steered = ["--model.name=tests.steered_model:steered", "--model.options.inner=char_transformer",
               f"--model.options.pause_file={pace.path}"]  # fmt: skip
    for job_id in jobs:
        env = _slurm_env(tmp_path, job_id=job_id, checkpoints=tmp_path / f"ckpt-{job_id}")
        # One address for both, as on a shared node; each job finds its own free port.
        del env["ETCD_PORT"]
        env["ELASTIC_TRAIN_ETCD_HOST"] = "127.0.0.2"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        audits.append(tmp_path / f"audit-{job_id}")
        logs.append(tmp_path / f"job-{job_id}.log")
        # More steps than TINY's: the checks below need both jobs to still be running.
        argv = ["bash", str(SBATCH), *TINY, *steered, f"--training.steps={LONG_STEPS}",
                f"--logging.audit_dir={audits[-1]}"]  # fmt: skip
        processes.append(_start(argv, env=env, cwd=REPO_ROOT, log=logs[-1]))
    roots = [psutil.Process(p.pid) for p in processes]
    deadline = time.monotonic() + DEADLINE_S
    # Once a job's agents run, its etcd is up, its user made and authentication on.
    while not all(_job_processes(root, "torchrun") for root in roots):
        for proc, log in zip(processes, logs, strict=True):
            assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the jobs' agents did not start"
        time.sleep(0.1)
    first, second = (
        _job_facts(job_id, root, tmp_path / "jobs", tmp_path)
        for job_id, root in zip(jobs, roots, strict=True)
    )
    assert first.endpoint != second.endpoint
    _check_etcd(first, second)
    _check_etcd(second, first)
    assert first.etcd.is_running() and second.etcd.is_running(), "checked while the jobs ran"
    pace.set(0.0)  # checked: the jobs may finish now
    _wait_all(processes, logs)
    for proc, log, audit in zip(processes, logs, audits, strict=True):
        assert proc.returncode == 0, log.read_text()[-3000:]
        text = log.read_text()  # the agents' and the workers' output too
        assert not any(v in text for v in first.hidden | second.hidden), "a secret in a log"
        assert _result(audit)["final_step"] == LONG_STEPS, text[-3000:]
        assert 2 in _world_sizes(audit), f"the two nodes never trained in one world: {text[-3000:]}"
    # Each job took its etcd, certificates, passwords and secret with it.
    assert not list((tmp_path / "jobs").iterdir())
    for job in (first, second):
        host, port = job.endpoint.rsplit(":", 1)
        with pytest.raises(OSError):
            socket.create_connection((host, int(port)), timeout=1).close()
