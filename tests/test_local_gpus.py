"""``elastic-train local`` on a machine with GPUs: each node its own, or all on the CPU.

The plan is a pure function of the GPUs and the run's shape, tested here on
lists of GPU names. The runs on a real GPU are in tests/test_cuda.py (one GPU
with three nodes trains on the CPU; NCCL asked for there is refused).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from elastic_train.errors import ConfigError
from elastic_train.local import cluster as cluster_module
from elastic_train.local import gpus as gpus_module
from elastic_train.local.chaos import parse_schedule
from elastic_train.local.cluster import ClusterSpec, LocalCluster
from elastic_train.local.gpus import GPU_DRIVER_PATHS, GpuPlan, local_gpus, plan_gpus, visible_gpus
from elastic_train.local.runner import effective_config_toml


def test_enough_gpus_give_every_node_its_own_slice() -> None:
    # Node 5 joins later (chaos join:5): indexes need not be contiguous.
    plan = plan_gpus(["0", "1", "2", "3", "4"], nodes=[0, 5], nproc_per_node=2, backend="auto")
    assert plan.devices == {0: "0,1", 5: "2,3"}
    assert plan.worker_args == ()
    assert plan.env_for(5) == {"CUDA_VISIBLE_DEVICES": "2,3"}


def test_too_few_gpus_under_auto_train_on_the_cpu_and_say_why() -> None:
    plan = plan_gpus(["0"], nodes=[0, 1, 2], nproc_per_node=1, backend="auto")
    assert plan.worker_args == ("--elastic.backend=gloo",)
    assert plan.env_for(0) == {}
    assert "3 workers" in plan.reason and "1 GPU(s)" in plan.reason, plan.reason


def test_too_few_gpus_for_an_explicit_nccl_is_refused_naming_the_counts() -> None:
    with pytest.raises(ConfigError) as caught:
        plan_gpus(["0", "1"], nodes=[0, 1, 2], nproc_per_node=1, backend="nccl")
    message = str(caught.value)
    assert "elastic.backend = 'nccl'" in message
    assert "3 workers" in message and "2 GPU(s)" in message and "at most 2 workers" in message


@pytest.mark.parametrize(
    ("gpus", "backend", "reason"),
    [([], "auto", "no GPU visible"), ([], "nccl", "no GPU visible"),
     (["0"], "gloo", "elastic.backend = 'gloo'")],
)  # fmt: skip
def test_no_gpu_or_gloo_leaves_the_nodes_alone(gpus: list[str], backend: str, reason: str) -> None:
    plan = plan_gpus(gpus, nodes=[0, 1, 2], nproc_per_node=2, backend=backend)
    assert plan == GpuPlan(reason=reason)


def test_a_script_of_its_own_keeps_its_arguments_and_gets_slices_where_they_suffice() -> None:
    too_few = plan_gpus(["0"], nodes=[0, 1], nproc_per_node=1, backend=None)
    assert too_few.worker_args == () and too_few.devices == {}
    enough = plan_gpus(["0", "1"], nodes=[0, 1], nproc_per_node=1, backend=None)
    assert enough.devices == {0: "0", 1: "1"}


def test_visible_gpus_keep_the_names_cuda_visible_devices_gives() -> None:
    assert visible_gpus({}, 2) == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a1, GPU-b2,3"}, 2) == ["GPU-a1", "GPU-b2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, 0) == []


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> None:
    # The hardware is what is faked: CI has no GPU.
    monkeypatch.setattr(cluster_module, "local_gpus", lambda environ: list(names))


def test_the_runner_counts_joiners_and_hands_the_workers_gloo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_gpus(monkeypatch, ["0", "1"])
    # Two nodes fit two GPUs; a third that the schedule starts does not.
    spec = ClusterSpec(nodes=2, chaos=parse_schedule("join:2@step5"))
    config = tomllib.loads(effective_config_toml(spec, run_dir=tmp_path))
    assert config["elastic"]["backend"] == "gloo"
    two = LocalCluster(ClusterSpec(nodes=2), run_dir=tmp_path)
    assert two.gpus.devices == {0: "0", 1: "1"}
    assert "--elastic.backend=gloo" not in two.worker_args()


def test_the_runner_refuses_nccl_before_it_makes_the_run_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_gpus(monkeypatch, ["0"])
    spec = ClusterSpec(nodes=2, script_args=("--elastic.backend=nccl",))
    with pytest.raises(ConfigError, match="2 workers may run at once, and 1 GPU"):
        LocalCluster(spec, run_dir=tmp_path / "run").start()
    assert not (tmp_path / "run").exists()


def test_without_a_gpu_the_workers_get_what_they_asked_for(tmp_path: Path) -> None:
    cluster = LocalCluster(ClusterSpec(nodes=3), run_dir=tmp_path)
    if cluster.gpus.reason != "no GPU visible":
        pytest.skip("this machine has a GPU (tests/test_cuda.py runs the GPU cases)")
    assert cluster.gpus == GpuPlan()
    assert not any(arg.startswith("--elastic.backend") for arg in cluster.worker_args())


def test_a_script_of_api_fits_is_planned_like_main_and_one_with_flags_of_its_own_is_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_gpus(monkeypatch, ["0"])
    script = str(tmp_path / "train.py")
    fit = LocalCluster(ClusterSpec(nodes=2, script=script), run_dir=tmp_path)
    assert fit.worker_args()[-1] == "--elastic.backend=gloo"
    own = ClusterSpec(nodes=2, script=script, script_args=("--epochs", "3"))
    assert "--elastic.backend=gloo" not in LocalCluster(own, run_dir=tmp_path).worker_args()


def test_without_a_gpu_driver_torch_is_not_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def count() -> int:
        raise AssertionError("torch.cuda was asked on a machine without a GPU driver")

    monkeypatch.setattr(torch.cuda, "device_count", count)
    monkeypatch.setattr(gpus_module, "GPU_DRIVER_PATHS", (str(tmp_path / "nvidia"),))
    assert local_gpus({}) == []
    (tmp_path / "nvidia").mkdir()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert local_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}) == ["GPU-a", "GPU-b"]


@pytest.mark.slow
def test_the_runner_of_a_run_without_gpus_never_imports_torch(tmp_path: Path) -> None:
    """Only the agents and workers pay torch's import: 2-3 s of the runner's start
    before any node started, on a 2-core box."""
    if any(Path(path).exists() for path in GPU_DRIVER_PATHS):
        pytest.skip("a GPU driver is here: the runner asks torch how many GPUs it sees")
    summary = tmp_path / "summary.json"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "elastic_train.cli", "local", "--nodes", "1",
         "--quiet", "--metrics-port", "0", "--run-dir", str(tmp_path / "run"),
         "--json", str(summary), "--training.steps=3", "--model.name=mlp",
         "--data.name=synthetic"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(summary.read_text())["exactly_once"]
    # The nodes log to the run dir: this stderr is the runner's alone.
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert "elastic_train.local.runner" in imported  # -X importtime did report
    assert not {m for m in imported if m.split(".")[0] == "torch"}
