"""The CUDA/NCCL paths on one GPU: skipped without one (CI has none).

Run on a GPU machine with ``pytest tests/test_cuda.py``. One GPU holds one
NCCL rank (NCCL refuses two ranks on one device), so every run here is one
node of one worker; what they check is what only a GPU exercises:

- a node killed mid-run and started again resumes from the newest of its
  /dev/shm snapshot and the disk checkpoint, both written from CUDA tensors
  (model, optimizer, CUDA RNG), and ends where a fault-free run on the same
  GPU does, exactly once;
- a SIGTERM (preemption) saves the checkpoint from CUDA tensors and the
  restarted node loads it (``weights_only``) onto the GPU, same end;
- ``training.parallel = "fsdp2"`` on CUDA through a kill and a restart;
- in-process recovery aborts the NCCL communicator
  (``_abort_process_group``), re-forms the group on the same GPU and redoes
  the failed step: same end as a run without the failure;
- every one of those worker starts is forked by the node's zygote (warm start),
  which imported torch without initializing CUDA;
- ``elastic-train local`` with more workers than GPUs trains on the CPU (its
  default of three nodes on one GPU failed with NCCL's "Duplicate GPU detected"
  until the timeout), and refuses an explicit NCCL at once;
- a worker that never used CUDA saves and restores its random generators
  without initialising CUDA (no context on GPU 0 for a gloo worker);
- a zygote whose ``preload`` initialised CUDA exits rather than fork workers
  that could not use it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from chaos_runs import (
    PACED,
    PACED_MLP,
    UNPACED,
    assert_ends_like_reference,
    assert_ran_exactly_once,
    run_chaos,
)

from elastic_train.cli import EXIT_USAGE
from elastic_train.config.job import ElasticConfig
from elastic_train.errors import ConfigError
from elastic_train.local.cluster import MAIN_SCRIPT
from elastic_train.training.distributed import WorkerEnv, worker_device

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)"),
]

STEPS = 30
ARGS = [*PACED_MLP, f"--training.steps={STEPS}"]
ONE_NODE = ["--nodes", "1", "--min-nodes", "1"]


def _worker_events(run_dir: Path, event: str) -> list[dict]:
    """The JSON log lines named ``event`` that the run's processes wrote."""
    found = []
    for path in run_dir.rglob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if f'"{event}"' in line and line.lstrip().startswith("{"):
                try:
                    found.append(json.loads(line))
                except ValueError:
                    continue
    return found


def _assert_on_the_gpu(run_dir: Path) -> None:
    groups = _worker_events(run_dir, "process_group_ready")
    assert groups, "no process_group_ready in the run's logs"
    assert {(g["backend"], g["device"]) for g in groups} == {("nccl", "cuda:0")}, groups
    # Every worker start, restarts included, was forked by the node's zygote: a
    # child forked after CUDA was initialized could not use the GPU, and a start
    # the zygote declined would fall back quietly to a cold one.
    assert len(_worker_events(run_dir, "warm_start_forked")) == len(groups), groups
    assert not _worker_events(run_dir, "warm_start_unavailable")


def _assert_resumed_once_exactly(summary: dict, *, source: set[str]) -> None:
    assert summary["completed"], summary
    assert summary["final_step"] == STEPS
    assert summary["exactly_once"], summary["exactly_once_detail"]
    resumed = [r for r in summary["recoveries"] if r["restore_source"] is not None]
    assert resumed, summary["recoveries"]
    assert {r["restore_source"] for r in resumed} <= source, summary["recoveries"]
    # The whole job went down: the newest of the snapshot and the disk
    # checkpoint (every 4 steps) wins.
    assert all(0 <= r["lost_steps"] <= 4 for r in resumed), summary["recoveries"]


@pytest.mark.parametrize(
    ("chaos", "extra", "source"),
    [
        ("kill:0@step10,join:0@step10", [], {"snapshot", "disk"}),
        # Without snapshots: a snapshot of the step the preemption saved wins the
        # tie with the disk (restore.decide), and the adaptive cadence may have
        # taken one (it did on an H200), so the disk path would go untested.
        ("term:0@step10,join:0@step10", ["--elastic.snapshot=false"], {"disk"}),
    ],
    ids=["kill-snapshot", "sigterm-checkpoint"],
)
def test_one_gpu_node_restarted_resumes_and_ends_like_a_fault_free_run(
    tmp_path: Path, chaos: str, extra: list[str], source: set[str]
) -> None:
    run_dir = tmp_path / "run"
    summary = run_chaos(run_dir, [*ONE_NODE, "--chaos", chaos], *ARGS, *extra, PACED)
    _assert_on_the_gpu(run_dir)
    _assert_resumed_once_exactly(summary, source=source)
    reference = [sys.executable, str(MAIN_SCRIPT), *ARGS, UNPACED]
    assert_ends_like_reference(summary, run_dir, reference, tmp_path=tmp_path)


def test_fsdp2_on_one_gpu_through_a_kill_ends_like_a_fault_free_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*ARGS, "--training.parallel=fsdp2"]
    summary = run_chaos(run_dir, [*ONE_NODE, "--chaos", "kill:0@step10,join:0@step10"],
                        *args, PACED)  # fmt: skip
    _assert_on_the_gpu(run_dir)
    _assert_resumed_once_exactly(summary, source={"snapshot", "disk"})
    reference = [sys.executable, str(MAIN_SCRIPT), *args, UNPACED]
    assert_ends_like_reference(summary, run_dir, reference, tmp_path=tmp_path)


def test_inprocess_recovery_aborts_the_nccl_group_and_redoes_the_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    model = "--model.name=tests.failing_model:fails_once_mlp"
    inprocess = ["--elastic.recovery=inprocess", "--elastic.pg_timeout_seconds=30"]
    summary = run_chaos(run_dir, ONE_NODE, *ARGS, model, *inprocess,
                        "--model.options.fail_at_call=10")  # fmt: skip
    _assert_on_the_gpu(run_dir)
    assert summary["completed"], summary
    assert summary["final_step"] == STEPS
    assert summary["exactly_once"], summary["exactly_once_detail"]
    assert not _worker_events(run_dir, "process_group_abort_failed")
    (recovered,) = _worker_events(run_dir, "inprocess_recovered")
    assert recovered["world_size"] == 1 and recovered["lost_steps"] == 1, recovered
    # One worker process did it all: its one audit file has the in-process resume.
    (audit,) = (run_dir / "audit").glob("worker-*.jsonl")
    sources = [json.loads(line).get("source") for line in audit.read_text().splitlines()
               if json.loads(line).get("kind") == "resume"]  # fmt: skip
    assert sources[1:] == ["inprocess"], sources
    # The standalone reference cannot recover in-process (no etcd): it never fails.
    reference = [sys.executable, str(MAIN_SCRIPT), *ARGS, model, "--model.options.fail_at_call=0"]
    assert_ends_like_reference(summary, run_dir, reference, tmp_path=tmp_path)


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_examples_on_one_gpu_through_a_kill_run_exactly_once(tmp_path: Path, name: str) -> None:
    """GPT-2 under FSDP2 (disk checkpoints through torch.distributed.checkpoint) and
    ResNet-18 in bf16 autocast with pinned DataLoader workers, on CUDA."""
    pytest.importorskip("transformers" if name == "gpt2" else "torchvision")
    run_dir = tmp_path / "run"
    config = Path(__file__).resolve().parents[1] / "examples" / name / "local.toml"
    summary = run_chaos(run_dir, [*ONE_NODE, "--chaos", "kill:0@step12,join:0@step12"],
                        "--config", str(config), "--training.epochs=2")  # fmt: skip
    _assert_on_the_gpu(run_dir)
    assert summary["completed"], summary
    assert summary["exactly_once"], summary["exactly_once_detail"]
    assert [r["kind"] for r in summary["recoveries"]] == ["kill", "join"], summary["recoveries"]


def test_compiled_on_one_gpu_through_a_kill_ends_like_an_uncompiled_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    summary = run_chaos(run_dir, [*ONE_NODE, "--chaos", "kill:0@step10,join:0@step10"],
                        *ARGS, PACED, "--training.compile=true")  # fmt: skip
    _assert_on_the_gpu(run_dir)
    assert len(_worker_events(run_dir, "compile_enabled")) >= 2  # the start and the restart
    _assert_resumed_once_exactly(summary, source={"snapshot", "disk"})
    reference = [sys.executable, str(MAIN_SCRIPT), *ARGS, UNPACED]
    # Inductor's fused kernels change the summation order only.
    assert_ends_like_reference(summary, run_dir, reference, tmp_path=tmp_path, atol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() >= 3, reason="three GPUs give each node its own")
def test_three_local_nodes_on_fewer_gpus_train_on_the_cpu_exactly_once(tmp_path: Path) -> None:
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so the runner
    hands every worker gloo instead of letting them fail until the timeout."""
    run_dir = tmp_path / "run"
    summary = run_chaos(run_dir, ["--nodes", "3", "--chaos", "kill:1@step10,join:1@step14"],
                        *ARGS, PACED)  # fmt: skip
    groups = _worker_events(run_dir, "process_group_ready")
    assert groups and {(g["backend"], g["device"]) for g in groups} == {("gloo", "cpu")}, groups
    assert_ran_exactly_once(summary, steps=STEPS)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="two GPUs hold two NCCL ranks")
def test_nccl_asked_for_with_fewer_gpus_than_local_workers_is_refused_at_once(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "elastic_train.cli", "local", "--nodes", "2", "--quiet",
               "--run-dir", str(run_dir), *ARGS, "--elastic.backend=nccl"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_USAGE, proc.stderr[-2000:]
    assert "2 workers may run at once, and 1 GPU(s) are visible" in proc.stderr, proc.stderr
    assert not (run_dir / "audit").exists()


def test_a_local_rank_without_its_gpu_is_refused_naming_both() -> None:
    count = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=rf"LOCAL_RANK {count} needs GPU {count} .* {count} GPU"):
        worker_device(WorkerEnv(local_rank=count), ElasticConfig(backend="nccl"))


_RNG_PROBE = """
import json, torch
from elastic_train.training.rng import capture_rng_state
before = capture_rng_state()  # CUDA not initialised yet
untouched = not torch.cuda.is_initialized()
torch.zeros(1, device="cuda")
saved = capture_rng_state()  # as a GPU worker saves it
print(json.dumps({"cuda_in_state": "cuda" in before, "untouched": untouched,
                  "saved_cuda": "cuda" in saved}))
"""

_RNG_CPU_WORKER = """
import json, sys, torch
from elastic_train.training.rng import capture_rng_state, restore_rng_state
state = torch.load(sys.argv[1], weights_only=True)
restore_rng_state(state)  # a state from a GPU worker, into a CPU worker
again = capture_rng_state()
print(json.dumps({"initialized": torch.cuda.is_initialized(), "cuda_in_state": "cuda" in again}))
"""


def test_rng_capture_leaves_cuda_alone_in_a_worker_that_never_used_it(tmp_path: Path) -> None:
    """A gloo worker on a GPU host (more local nodes than GPUs) must not open a CUDA
    context on GPU 0 just to save and restore its generators."""
    saved = tmp_path / "rng.pt"
    probe = _RNG_PROBE + f"torch.save(saved, {str(saved)!r})\n"
    first = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=120, check=True)  # fmt: skip
    assert json.loads(first.stdout) == {
        "cuda_in_state": False,
        "untouched": True,
        "saved_cuda": True,
    }
    second = subprocess.run([sys.executable, "-c", _RNG_CPU_WORKER, str(saved)],
                            capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    assert json.loads(second.stdout) == {"initialized": False, "cuda_in_state": False}


def test_a_preload_that_initialises_cuda_ends_the_zygote(capfd: pytest.CaptureFixture[str]) -> None:
    """Workers forked after CUDA started could not use it: the zygote exits instead."""
    from elastic_train.agent.worker_entry import WorkerEntry
    from elastic_train.agent.zygote import EXIT_UNSAFE_PRELOAD, ZygoteProcess

    parent = Path(tempfile.mkdtemp(prefix="et-cuda-"))  # a short path for the socket
    zygote = ZygoteProcess(
        WorkerEntry(str(MAIN_SCRIPT)), parent_dir=parent,
        environ={**os.environ, "PRELOAD_PROBE_CUDA": "1"}, preload=["tests.preload_probe"],
    )  # fmt: skip
    try:
        assert zygote.proc.wait(120) == EXIT_UNSAFE_PRELOAD
    finally:
        zygote.close()
        shutil.rmtree(parent, ignore_errors=True)
    assert "started CUDA; a fork of this process is not safe" in capfd.readouterr().err
