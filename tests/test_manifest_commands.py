"""The deployment files' commands really run.

The trainer command of the rendered Kubernetes Job, and the torchrun line of
the Slurm script, are run as real processes against a real etcd until
training completes, so a typo in a manifest's command line fails CI. Only
what a cluster would provide is stood in for: service names become loopback
endpoints, volumes become temporary directories, ``srun`` starts one task
per "node" on this machine. Training is kept tiny with config overrides.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import psutil
import pytest
from k8s_manifests import (
    RDZV_SECRET_PATH,
    REPO_ROOT,
    PodIdentity,
    container,
    find,
    local_process,
    rdzv_parameters,
    rdzv_secrets,
    render,
    replace_paths,
)
from secure_etcd import ETCD_SCRIPTS, PASSWORD, secure_etcd, trainer_secrets

from elastic_train.config.load import load_config
from elastic_train.errors import EXIT_CONFIG_ERROR
from elastic_train.etcd.server import free_port
from elastic_train.local import proctree
from elastic_train.torchrun_plugin import check_rdzv_conf

STEPS = 40
TINY = (
    "--model.hidden_size=16",
    "--model.num_layers=1",
    "--model.num_heads=2",
    "--data.seq_len=16",
    f"--training.steps={STEPS}",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=8",
    "--training.final_loss_samples=16",
    "--schedule.warmup_steps=0",
    "--checkpoint.interval_steps=10",
)
DEADLINE_S = 240.0
SBATCH = REPO_ROOT / "deploy" / "slurm" / "train.sbatch"


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Started processes; their whole trees are killed at the end, whatever happened."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            proctree.kill_tree(psutil.Process(proc.pid))
        proc.wait(timeout=30)


def _start(
    argv: list[str], *, env: dict[str, str], cwd: Path, log: Path
) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as response:
            return response.read().decode()
    except OSError:
        return ""


def _wait_all(
    procs: list[subprocess.Popen[bytes]], logs: list[Path], *, metrics_ports: list[int] = ()
) -> set[int]:
    """Wait for every process; returns the metrics ports that served elastic_train metrics."""
    served: set[int] = set()
    deadline = time.monotonic() + DEADLINE_S
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in logs)
            pytest.fail(f"not finished within {DEADLINE_S:.0f} s\n{tails}")
        served |= {p for p in set(metrics_ports) - served if "elastic_train_" in _scrape(p)}
        time.sleep(0.2)
    return served


def _result(audit_dir: Path) -> dict:
    return json.loads((audit_dir / "result.json").read_text())


def _world_sizes(audit_dir: Path) -> set[int]:
    return {r["world_size"] for r in _records(audit_dir, "step")}


@pytest.mark.slow
def test_two_pods_of_the_rendered_job_train_to_the_end(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    # The tls overlay is the cpu overlay plus etcd TLS and authentication, so
    # this runs every part of the trainer's command line, against an etcd
    # secured by deploy/etcd/'s scripts.
    objs = render("tls")
    job = find(objs, "Job", "elastic-train")
    pod_spec = job["spec"]["template"]["spec"]
    assert job["spec"]["parallelism"] == 2
    audit, shared = tmp_path / "audit", tmp_path / "pvc" / "elastic-train-checkpoints"
    ports = [free_port(), free_port()]
    with secure_etcd(tmp_path / "etcd") as etcd:
        trainers = []
        for index in range(job["spec"]["parallelism"]):
            pod = PodIdentity(
                name=f"elastic-train-{index}", namespace=job["metadata"]["namespace"],
                index=index, job_uid="6d1f0b52-k8s-test",
            )  # fmt: skip
            make = dict(
                pod=pod, root=tmp_path, substitutions={"etcd:2379": etcd.server.endpoint},
                host_ports={9400: ports[index]},
                secrets={**trainer_secrets(etcd.certs), **rdzv_secrets()},
            )  # fmt: skip
            init = local_process(objs, pod_spec, container(pod_spec, "config-check"), **make)
            checked = subprocess.run(
                init.argv, env={**os.environ, **init.env}, cwd=init.cwd,
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert checked.returncode == 0, checked.stderr
            trainer = local_process(objs, pod_spec, container(pod_spec, "trainer"), **make)
            # In the trainer the ConfigMap's /checkpoints is the PVC both pods share.
            config_path = next(a for a in trainer.argv if a.endswith("train.toml"))
            assert load_config(config_path).checkpoint.dir == str(shared)
            trainers.append((trainer, pod))
        logs = []
        for trainer, pod in trainers:
            logs.append(tmp_path / f"{pod.name}.log")
            argv = [*trainer.argv, *TINY, f"--logging.audit_dir={audit}"]
            env = {**os.environ, **trainer.env}
            processes.append(_start(argv, env=env, cwd=trainer.cwd, log=logs[-1]))
        served = _wait_all(processes, logs, metrics_ports=ports)
    for proc, log in zip(processes, logs, strict=True):
        assert proc.returncode == 0, log.read_text()[-3000:]
    assert _result(audit)["final_step"] == STEPS
    assert 2 in _world_sizes(audit), "the two pods never trained in one world"
    checkpoints = sorted(shared.glob("step-*"))
    assert checkpoints and checkpoints[-1].name.endswith(f"{STEPS:09d}")
    # Each node served its metrics on the port the manifest names `metrics`.
    assert served == set(ports)


@pytest.mark.slow
def test_a_bad_config_fails_the_init_container_with_the_failjob_exit_code(tmp_path: Path) -> None:
    objs = render("cpu")
    job = find(objs, "Job", "elastic-train")
    pod_spec = job["spec"]["template"]["spec"]
    (volume,) = [v for v in pod_spec["volumes"] if v["name"] == "config"]
    config_map = find(objs, "ConfigMap", volume["configMap"]["name"])
    config_map["data"]["train.toml"] = config_map["data"]["train.toml"].replace(
        "steps = 5000", 'steps = "many"'
    )
    pod = PodIdentity(name="elastic-train-0", namespace="elastic-train", index=0, job_uid="x")
    init = local_process(
        objs,
        pod_spec,
        container(pod_spec, "config-check"),
        pod=pod,
        root=tmp_path,
        substitutions={},
    )
    proc = subprocess.run(
        init.argv, env={**os.environ, **init.env}, cwd=init.cwd,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == EXIT_CONFIG_ERROR
    assert "training.steps" in proc.stderr
    (rule,) = [r for r in job["spec"]["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert proc.returncode in rule["onExitCodes"]["values"]


FAKE_SRUN = """#!/usr/bin/env bash
# srun stand-in: runs the command once per node of the allocation, as
# `srun --ntasks-per-node=1` does, each with that node's SLURM_* variables.
set -euo pipefail
while [[ $# -gt 0 && $1 == -* ]]; do
    echo "$1" >>"$FAKE_SRUN_OPTIONS"
    shift
done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 ELASTIC_TRAIN_NODE=node$node "$@" &
    pids+=("$!")
done
rc=0
for pid in "${pids[@]}"; do
    wait "$pid" || rc=$?
done
exit "$rc"
"""


def _sbatch_options() -> dict[str, str]:
    options = {}
    for line in SBATCH.read_text().splitlines():
        if match := re.match(r"#SBATCH --([\w-]+)(?:=(\S+))?", line):
            options[match[1]] = match[2] or ""
    return options


def test_slurm_signal_is_the_trainers_preemption_signal() -> None:
    options = _sbatch_options()
    signal_name, _, seconds = options["signal"].partition("@")
    assert signal_name == "USR1" and int(seconds) >= 60
    cfg = load_config(REPO_ROOT / "deploy" / "config" / "train.toml")
    assert cfg.elastic.preemption_signal in (signal_name, f"SIG{signal_name}")
    assert "no-kill" in options, "a lost node must shrink the job, not end it"


def _slurm_env(tmp_path: Path, *, job_id: str, checkpoints: Path) -> dict[str, str]:
    """What sbatch would hand the script on a 2-node allocation; srun is the stand-in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    path = [str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]
    env = {
        **os.environ, "PATH": os.pathsep.join(path),
        "SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "elastic-train", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_SUBMIT_DIR": str(REPO_ROOT), "FAKE_SRUN_OPTIONS": str(tmp_path / f"srun-{job_id}"),
        # No etcd endpoint given: the script starts etcd on the first node.
        "ETCD_PORT": str(free_port()), "ELASTIC_TRAIN_CHECKPOINT_DIR": str(checkpoints),
        "ELASTIC_TRAIN_ETCD_HOST": "127.0.0.1", "ELASTIC_TRAIN_JOBS_DIR": str(tmp_path / "jobs"),
        # The script's node-local etcd data (mktemp): here even if a failed test kills it.
        "TMPDIR": str(tmp_path),
        # Two "nodes" share this machine's network: let each pick a free port.
        "ELASTIC_TRAIN_METRICS_PORT": "0",
    }  # fmt: skip
    env.pop("ELASTIC_TRAIN_ETCD_ENDPOINT", None)
    env.pop("PET_LOG_DIR", None)  # conftest's; the script passes its own --log-dir
    return env


def _records(audit_dir: Path, kind: str) -> list[dict]:
    lines = (line for p in audit_dir.glob("worker-*.jsonl") for line in p.read_text().splitlines())
    records = (json.loads(line) for line in lines if line.strip())
    return [r for r in records if r.get("kind") == kind]


def _steps_done(audit_dir: Path) -> int:
    return max((r["step"] for r in _records(audit_dir, "step")), default=0)


def _signal_step(root: psutil.Process, sig: int) -> int:
    """Signal every process of the "job step" but srun and etcd, as slurmstepd does:
    torchrun, the zygote and the workers it forked, the data loaders; how many."""
    hit = 0
    for proc in proctree.descendants(root):
        with contextlib.suppress(psutil.NoSuchProcess):
            if Path(proc.cmdline()[0]).name in ("bash", "sh", "etcd"):  # the batch script, srun
                continue
            proc.send_signal(sig)
            hit += 1
    return hit


@pytest.mark.slow
def test_slurm_script_preempts_on_usr1_and_a_resubmission_finishes(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    audit, checkpoints = tmp_path / "audit", tmp_path / "checkpoints"
    argv = ["bash", str(SBATCH), *TINY, f"--logging.audit_dir={audit}"]
    first = _slurm_env(tmp_path, job_id="4242", checkpoints=checkpoints)
    log = tmp_path / "job-4242.log"
    processes.append(_start(argv, env=first, cwd=REPO_ROOT, log=log))
    deadline = time.monotonic() + DEADLINE_S
    while _steps_done(audit) < 5:
        assert processes[0].poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no training step within the deadline"
        time.sleep(0.1)
    # --signal=USR1@90: the time limit is near.
    assert _signal_step(psutil.Process(processes[0].pid), signal.SIGUSR1) >= 4
    _wait_all(processes[:1], [log])
    stopped = _steps_done(audit)
    assert stopped < STEPS, "the job should have stopped early"
    assert sorted(checkpoints.glob("step-*"))[-1].name.endswith(f"{stopped:09d}"), (
        "the preemption checkpoint holds the last completed step"
    )
    assert (tmp_path / "srun-4242").read_text().split() == [
        "--ntasks-per-node=1", "--kill-on-bad-exit=0",
    ]  # fmt: skip
    # The script's etcd is gone with the job, and torchrun left nothing in TMPDIR.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(first["ETCD_PORT"])), timeout=1).close()
    assert not list(tmp_path.glob("torchelastic_*")), "torchrun's log directories outlived the job"

    second = _slurm_env(tmp_path, job_id="4243", checkpoints=checkpoints)
    log = tmp_path / "job-4243.log"
    processes.append(_start(argv, env=second, cwd=REPO_ROOT, log=log))
    _wait_all(processes[1:], [log])
    assert processes[1].returncode == 0, log.read_text()[-3000:]
    assert _result(audit)["final_step"] == STEPS
    assert 2 in _world_sizes(audit), "the two nodes never trained in one world"
    resumed = _records(audit, "resume")
    assert max(r["restored_step"] for r in resumed) == stopped, "no step was lost"


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "tls"])
def test_the_rendezvous_backend_accepts_the_manifests_rdzv_options(
    overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = render(overlay)
    pod_spec = find(objs, "Job", "elastic-train")["spec"]["template"]["spec"]
    secrets = rdzv_secrets("ab" * 32)
    if overlay == "tls":
        certs = tmp_path / "certs"
        subprocess.run(
            ["bash", str(ETCD_SCRIPTS / "make-certs.sh"), str(certs)],
            check=True,
            capture_output=True,
        )
        secrets |= trainer_secrets(certs)
    pod = PodIdentity(name="elastic-train-0", namespace="elastic-train", index=0, job_uid="uid-1")
    trainer = local_process(
        objs, pod_spec, container(pod_spec, "trainer"), pod=pod, root=tmp_path,
        substitutions={"etcd:2379": "127.0.0.1:2379"}, secrets=secrets,
    )  # fmt: skip
    for name, value in trainer.env.items():
        monkeypatch.setenv(name, value)
    params = rdzv_parameters(trainer.argv[1:])
    assert params.run_id == "uid-1"
    config = check_rdzv_conf(params)[0]  # raises ValueError naming any key it does not accept
    assert config.key_prefix == "/elastic-train"
    assert config.secret == b"ab" * 32, "the job secret from the mounted Secret"
    if overlay == "tls":
        assert config.client.protocol == "https"
        assert Path(config.client.cert).read_text() == secrets["etcd-client-tls"]["client.crt"]
        assert (config.client.username, config.client.password) == ("elastic-train", PASSWORD)


def _operator_env(job: dict) -> dict[str, str]:
    """The PET_* variables the Kubeflow training operator gives an elastic
    PyTorchJob's pods (pkg/controller.v1/pytorch/elastic.go)."""
    policy = job["spec"]["elasticPolicy"]
    env = {
        "PET_RDZV_ENDPOINT": f"{policy['rdzvHost']}:{policy['rdzvPort']}",
        "PET_RDZV_BACKEND": policy["rdzvBackend"],
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
        "PET_RDZV_CONF": ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"]),
    }
    if "rdzvId" in policy:
        env["PET_RDZV_ID"] = policy["rdzvId"]
    return env


def test_the_pytorchjob_command_reaches_the_etcd_v3_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = render("kubeflow")
    job = find(objs, "PyTorchJob", "elastic-train")
    (worker,) = job["spec"]["pytorchReplicaSpecs"].values()
    pod_spec = worker["template"]["spec"]
    pod = PodIdentity(name="elastic-train-worker-0", namespace="elastic-train", index=0, job_uid="")
    trainer = local_process(
        objs, pod_spec, container(pod_spec, "trainer"), pod=pod, root=tmp_path,
        substitutions={}, secrets=rdzv_secrets("cd" * 32),
    )  # fmt: skip
    # The secret volume as local_process mounted it, for the operator's PET_RDZV_CONF too.
    secret_dir = {str(Path(RDZV_SECRET_PATH).parent): tmp_path / pod.name / "rdzv-secret"}
    operator_env = {k: replace_paths(v, secret_dir) for k, v in _operator_env(job).items()}
    for name, value in {**operator_env, **trainer.env}.items():
        monkeypatch.setenv(name, value)  # torchrun reads PET_* as its flags' defaults
    params = rdzv_parameters(trainer.argv[1:])
    assert params.backend == "etcd-v3"
    assert {e.name for e in entry_points(group="torchrun.handlers")} >= {"etcd-v3"}
    assert (params.min_nodes, params.max_nodes) == (1, worker["replicas"])
    # Without an explicit id every job would share torchrun's default "none".
    assert params.run_id == job["spec"]["elasticPolicy"]["rdzvId"] != "none"
    config = check_rdzv_conf(params)[0]
    assert config.key_prefix == "/elastic-train"
    assert config.secret == b"cd" * 32, "the job secret from the mounted Secret"
    assert trainer.env["ELASTIC_TRAIN_METRICS_PORT"] == "9400"
