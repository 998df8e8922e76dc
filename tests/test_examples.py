"""Every example in examples/ runs as its docstring says and actually trains.

Each one is run the way a user would (``python examples/X.py`` or torchrun), in a
scratch directory; the test reads the JSON log events and checks that the job
ran all its steps and that the model learned (final loss below the first step's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch_support import needs_fsdp2

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _events(output: str) -> list[dict[str, Any]]:
    events = []
    for line in output.splitlines():
        line = line.partition("]:")[2] if line.startswith("[") else line  # torchrun's prefix
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def _run(command: list[str], cwd: Path) -> tuple[list[dict[str, Any]], str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*command, "--logging.format=json"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _events(done.stdout + done.stderr), done.stdout


def _assert_trained(events: list[dict[str, Any]], *, steps: int) -> None:
    first = next(e for e in events if e["event"] == "step")
    finished = [e for e in events if e["event"] == "training_finished"]
    assert len(finished) == 1, [e["event"] for e in events]
    assert finished[0]["final_step"] == steps
    assert finished[0]["final_loss"] < first["loss"], (first, finished[0])


@pytest.mark.parametrize(
    ("script", "steps"),
    [("custom_model_dataset.py", 30), ("mixed_precision.py", 60), ("evaluation.py", 60)],
)
def test_single_process_example_trains(script: str, steps: int, tmp_path: Path) -> None:
    events, stdout = _run([sys.executable, str(EXAMPLES / script)], tmp_path)
    _assert_trained(events, steps=steps)
    if script == "evaluation.py":
        evaluations = [e for e in events if e["event"] == "evaluation"]
        assert [e["step"] for e in evaluations] == [20, 40, 60, 60]  # every 20 steps + at end
        assert evaluations[-1]["accuracy"] > 0.5  # digits, 10 classes
        assert "untrained model: loss" in stdout  # the stand-alone half


@pytest.mark.slow
def test_ddp_migration_example_runs_under_torchrun(tmp_path: Path) -> None:
    script = EXAMPLES / "ddp_migration" / "after_elastic_train.py"
    events, _ = _run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(script)], tmp_path
    )
    # 3 epochs of 2048 samples at a global batch of 32.
    _assert_trained(events, steps=3 * 2048 // 32)
    assert {e["world_size"] for e in events if e["event"] == "step"} == {2}
    assert any((tmp_path / "checkpoints" / "ddp_migration").glob("step-*"))


def test_own_script_example_trains_as_one_process(tmp_path: Path) -> None:
    """examples/own_script/my_train.py: the DDP tutorial's script calling fit()."""
    events, stdout = _run(
        [sys.executable, str(EXAMPLES / "own_script" / "my_train.py"), "--training.epochs=1"],
        tmp_path,
    )
    _assert_trained(events, steps=2048 // 32)
    assert "trained 64 steps, final loss" in stdout  # fit() returned the result on rank 0
    assert any((tmp_path / "checkpoints" / "own_script").glob("step-*"))


# -- examples/gpt2 and examples/resnet: `elastic-train local --config .../local.toml` --

CHAOS = "kill:1@step20,join:1@step40"
#: the module examples/gpt2 documents for ``--rdzv-conf preload=``
GPT2_PRELOAD = "transformers.models.gpt2.modeling_gpt2"


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=needs_fsdp2), "resnet"])
def test_local_toml_is_a_valid_config(name: str) -> None:
    """Every key the example's local.toml sets exists and holds a valid value."""
    from elastic_train.config.load import load_config

    cfg = load_config(EXAMPLES / name / "local.toml")
    assert cfg.model.name == f"examples.{name}.{name}:model"


def _run_local_example(name: str, run_dir: Path, *extra: str) -> dict[str, Any]:
    summary_path = run_dir / "summary-out.json"
    command = [
        sys.executable, "-m", "elastic_train.cli", "local",
        "--config", str(EXAMPLES / name / "local.toml"), "--nodes", "3", "--min-nodes", "2",
        "--chaos", CHAOS, "--json", str(summary_path), "--run-dir", str(run_dir / "run"),
        "--quiet", "--no-timeline", "--timeout", "400", "--metrics-port", "0", *extra,
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=run_dir, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True, text=True, timeout=480,
    )  # fmt: skip
    assert summary_path.is_file(), done.stderr[-3000:]
    return json.loads(summary_path.read_text())


def _assert_chaos_survived(summary: dict[str, Any], *, steps: int) -> None:
    assert summary["completed"], summary
    assert summary["final_step"] == steps
    assert summary["exactly_once"], summary["exactly_once_detail"]
    kinds = [(r["kind"], r["node"], r["world_size_after"]) for r in summary["recoveries"]]
    assert kinds == [("kill", 1, 2), ("join", 1, 3)], summary["recoveries"]


@needs_fsdp2
@pytest.mark.slow
def test_gpt2_example_survives_a_kill_and_a_join_exactly_once(tmp_path: Path) -> None:
    """A Hugging Face GPT-2 (dict batches, loss over the real tokens) on 3 nodes."""
    pytest.importorskip("transformers", reason="the examples extra: pip install -e '.[examples]'")
    # 4 epochs end near a loss of 2.5 (2.2 after 8): half the suite time for the same check.
    # The zygotes import GPT-2's modeling module once, so no restarted worker does.
    summary = _run_local_example("gpt2", tmp_path, "--training.epochs=4", "--rdzv-conf",
                                 f"preload={GPT2_PRELOAD}")  # fmt: skip
    _assert_chaos_survived(summary, steps=4 * 20)  # 319 clauses, 16 a step: 20 steps an epoch
    # ln(257) = 5.55 for an untrained model; a trained one predicts the text's bytes.
    assert summary["final_loss"] < 3.0, summary["final_loss"]
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("node*.log"))
    assert "elastic_train zygote: preload" not in logs  # neither failed nor fell back cold
    assert logs.count('"warm_start_forked"') >= 3 + 2 + 3  # first start, kill, join


def _torchvision_import_error() -> str | None:
    """Tried in a child process: a torchvision built for another torch fails halfway
    through registering its operators, which should not happen in this one."""
    done = subprocess.run(
        [sys.executable, "-c", "import torchvision"], capture_output=True, text=True, timeout=120
    )
    return None if done.returncode == 0 else done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_resnet_example_survives_a_kill_and_a_join_exactly_once(tmp_path: Path) -> None:
    """torchvision ResNet-18, augmentations in 2 DataLoader workers, DDP, bf16 autocast."""
    error = _torchvision_import_error()
    if error is not None:
        pytest.skip(f"torchvision does not import beside this torch: {error}")
    summary = _run_local_example("resnet", tmp_path, "--training.epochs=4")
    _assert_chaos_survived(summary, steps=4 * 16)  # 512 images, 32 a step
