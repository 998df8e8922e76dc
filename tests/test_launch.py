"""Launch modes: ``elastic-train spawn``, legacy ``--local_rank``, the Slurm mapping."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_procs import TINY_JOB

from elastic_train.audit import AuditLog, audit_exactly_once, read_result
from elastic_train.errors import EXIT_CONFIG_ERROR, ConfigError
from elastic_train.etcd.server import free_port
from elastic_train.launch import (
    expand_hostlist,
    slurm_torchrun_args,
    slurm_worker_env,
    worker_env,
)

REPO = Path(__file__).resolve().parents[1]
DEPLOY_SBATCH = REPO / "deploy" / "slurm" / "train.sbatch"
BIN = Path(sys.executable).parent

SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[07-09]",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_NODEID": "1",
    "SLURM_GPUS_ON_NODE": "4",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "12",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS_PER_NODE": "4",
}


def test_expand_hostlist() -> None:
    assert expand_hostlist("gpu[07-09,11],login1,a[1-2]") == [
        "gpu07", "gpu08", "gpu09", "gpu11", "login1", "a1", "a2",
    ]  # fmt: skip
    assert expand_hostlist("node1") == ["node1"]
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        expand_hostlist("gpu[x-3]")


def test_slurm_torchrun_mapping_uses_first_node_as_etcd_host() -> None:
    launch = slurm_torchrun_args(SLURM_ENV)
    assert (launch.nnodes, launch.node_rank, launch.nproc_per_node) == (3, 1, 4)
    assert launch.torchrun_args(min_nodes=2) == [
        "--nnodes=2:3", "--nproc-per-node=4", "--rdzv-backend=etcd",
        "--rdzv-endpoint=gpu07:2379", "--rdzv-id=slurm-4242",
    ]  # fmt: skip
    given = slurm_torchrun_args(SLURM_ENV, etcd_endpoint="etcd.svc:2379")
    assert given.rdzv_endpoint == "etcd.svc:2379"
    no_gpus = {k: v for k, v in SLURM_ENV.items() if k != "SLURM_GPUS_ON_NODE"}
    assert slurm_torchrun_args(no_gpus).nproc_per_node == 1


def test_slurm_task_per_gpu_mapping() -> None:
    assert slurm_worker_env(SLURM_ENV, master_port=29600) == {
        "RANK": "5", "WORLD_SIZE": "12", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "MASTER_ADDR": "gpu07", "MASTER_PORT": "29600",
    }  # fmt: skip
    compressed = {**SLURM_ENV, "SLURM_TASKS_PER_NODE": "4(x3)"}
    del compressed["SLURM_NTASKS_PER_NODE"]
    assert slurm_worker_env(compressed)["LOCAL_WORLD_SIZE"] == "4"


def test_slurm_mapping_errors_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        slurm_torchrun_args({})
    with pytest.raises(ConfigError, match="SLURM_NODEID"):
        slurm_torchrun_args({**SLURM_ENV, "SLURM_NODEID": "one"})
    with pytest.raises(ConfigError, match="SLURM_JOB_NUM_NODES=2"):
        slurm_torchrun_args({**SLURM_ENV, "SLURM_JOB_NUM_NODES": "2"})


def test_spawn_worker_env_matches_torchrun_names() -> None:
    env = worker_env(rank=1, world_size=2, master_port=1234)
    assert env["RANK"] == env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "1234"


@pytest.mark.parametrize(
    "script", [DEPLOY_SBATCH, REPO / "examples" / "slurm_srun.sbatch"], ids=["deploy", "example"]
)
def test_sbatch_script_lints(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-S", "warning", str(script)], check=True)


def _job(audit: Path, steps: int = 6) -> list[str]:
    # Evaluation every 3 steps and at the end, on the 98 training samples in
    # micro-batches of 16: the logged results must not depend on the world size.
    return [*TINY_JOB, f"training.steps={steps}", "checkpoint.dir=",
            f"logging.audit_dir={audit}", "logging.level=INFO", "eval.every_steps=3",
            "eval.at_end=true", "eval.batch_size=16"]  # fmt: skip


def _evaluations(stderr: str) -> list[dict]:
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    keys = ("step", "reason", "loss", "accuracy", "samples", "correct")
    return [
        {k: e[k] for k in keys}
        for e in events
        if e.get("event") == "evaluation" and e.get("rank") == 0
    ]


@pytest.mark.slow
def test_elastic_train_spawn_trains_like_one_process(tmp_path: Path) -> None:
    spawned, single = tmp_path / "spawn", tmp_path / "single"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    spawn = [str(BIN / "elastic-train"), "spawn", "--nproc", "2"]
    ours_run = subprocess.run([*spawn, *(f"--{o}" for o in _job(spawned))], check=True,
                              env=env, timeout=120, capture_output=True, text=True)  # fmt: skip
    # The legacy launcher passes --local-rank=0: accepted and ignored for the environment.
    legacy = [
        sys.executable,
        "-m",
        "torch.distributed.launch",
        "--nproc-per-node=1",
        f"--master-port={free_port()}",
        str(REPO / "elastic_train" / "main.py"),
    ]
    single_run = subprocess.run([*legacy, *(f"--{o}" for o in _job(single))], check=True,
                                env=env, timeout=120, capture_output=True, text=True)  # fmt: skip
    result = read_result(spawned)
    assert result is not None and result["final_step"] == 6 and result["world_size"] == 2
    log = AuditLog.load(spawned)
    assert audit_exactly_once(log, dataset_len=98).ok
    ours = torch.load(spawned / "final_params.pt", weights_only=True)
    reference = torch.load(single / "final_params.pt", weights_only=True)
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, atol=2e-6, rtol=0)
    evaluations = _evaluations(ours_run.stderr)
    assert [(e["step"], e["reason"]) for e in evaluations] == [
        (3, "interval"), (6, "interval"), (6, "end"),
    ]  # fmt: skip
    assert all(e["samples"] == 98 for e in evaluations)  # every sample once, none padded
    # Same parameters at step 3 (up to float summation order), so the same metrics.
    for ours_eval, single_eval in zip(evaluations, _evaluations(single_run.stderr), strict=True):
        assert ours_eval["correct"] == single_eval["correct"]
        assert ours_eval["loss"] == pytest.approx(single_eval["loss"], rel=1e-5)


@pytest.mark.slow
def test_spawn_reports_a_config_error_without_restarting(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(BIN / "elastic-train"), "spawn", "--nproc", "1", "--max-restarts", "3",
         "--training.steps=oops"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == EXIT_CONFIG_ERROR
    assert "training.steps" in proc.stderr
    assert proc.stderr.count("spawn_group") == 1
