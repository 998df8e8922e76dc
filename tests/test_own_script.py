"""A user's own script (tests/scripts/fit_script.py) that builds every part itself and
calls ``elastic_train.api.fit``: launched by ``elastic-train local --script`` on
real torchrun nodes against a real etcd, with a node killed and joining again.

One chaos run serves two tests: its audit (every sample exactly once), and its
final parameters against the same script run as one process without faults.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chaos_runs import (
    ENV,
    KILL_THEN_JOIN,
    assert_completed_exactly_once,
    assert_ends_like_reference,
    worker_records,
)
from steered_runs import JOIN_WAIT_S, Pace, run_steered
from torch import nn
from workers import run_code

from elastic_train.api import fit
from elastic_train.errors import EXIT_CONFIG_ERROR

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fit_script.py"
#: 96 samples, 16 a step: 6 steps an epoch. At 0.1 s or more a step, the 140
#: steps after the join trigger leave the joiner 14 s or more to start.
STEPS = 150


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """``elastic-train local --script`` on 3 nodes; node 1 killed at world size 3, back at 2."""
    run_dir = tmp_path_factory.mktemp("own_script")
    # 0.1 s a forward, 0.5 s from the kill, until the rejoined world trains; then none
    # (tests/steered_runs.py).
    pace = Pace(run_dir.parent / f"{run_dir.name}-pause", 0.1)
    command = [
        *KILL_THEN_JOIN, "--run-dir", str(run_dir), "--timeout", "240", "--metrics-port", "0",
        "--script", str(SCRIPT),
        "--rdzv-conf", "warm_start=1",  # the script calls hand_over
        f"--training.steps={STEPS}",  # the script's command line, read on top of its config
    ]  # fmt: skip
    env = {**ENV, "FIT_SCRIPT_PAUSE_FILE": str(pace.path)}
    summary = run_steered(run_dir, command, pace=pace, nodes=3, env=env, join_wait=JOIN_WAIT_S)
    return summary, run_dir


@pytest.mark.slow
def test_own_script_survives_a_kill_and_a_join_exactly_once(chaos_run: tuple[dict, Path]) -> None:
    summary, run_dir = chaos_run
    assert_completed_exactly_once(summary, steps=STEPS)
    assert f"{STEPS // 6} finished epochs" in summary["exactly_once_detail"]
    assert summary["nodes"] == {"node0": "exited(0)", "node1": "exited(0)", "node2": "exited(0)"}
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("node*.log"))
    assert "warm_start_forked" in logs  # the script's workers came from the nodes' zygotes
    resumes = worker_records(run_dir, "resume")
    # After the kill and the join the workers restored the step they had reached.
    assert max(r["restored_step"] for r in resumes) >= 6, resumes


@pytest.mark.slow
def test_own_script_ends_where_an_uninterrupted_run_does(
    chaos_run: tuple[dict, Path], tmp_path: Path
) -> None:
    summary, run_dir = chaos_run
    reference = [sys.executable, str(SCRIPT), f"--training.steps={STEPS}"]
    unpaced = {"FIT_SCRIPT_SECONDS_PER_FORWARD": "0"}
    assert_ends_like_reference(summary, run_dir, reference, tmp_path=tmp_path, env=unpaced)


def _mean_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"optimizer": "instance"}, "fit(optimizer=...): got a AdamW; expected a factory"),
        ({"model": "not a module"}, "fit(model=...): got a str; expected a torch.nn.Module"),
        ({"config": {"trainig": {}}}, "unknown section [trainig] in fit(config=...)"),
        ({"config": {"training": {"stpes": 3}}}, "unknown key training.stpes"),
    ],
)
def test_bad_arguments_exit_78_naming_them_before_anything_starts(
    kwargs: dict, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = nn.Linear(4, 2)
    if kwargs.get("optimizer") == "instance":
        kwargs = {"optimizer": torch.optim.AdamW(model.parameters())}
    arguments = {
        "model": model,
        "dataset": [(torch.zeros(4), 0)] * 8,
        "loss": _mean_loss,
        "argv": [],
        **kwargs,
    }
    with pytest.raises(SystemExit) as exited:
        fit(**arguments)
    assert exited.value.code == EXIT_CONFIG_ERROR
    assert message in capsys.readouterr().err


def test_a_wrong_loss_form_is_refused_naming_the_script_loss(tmp_path: Path) -> None:
    """A mean loss with the default per-sample form: refused at the first micro-batch,
    in one real process, with the loss named as the script passed it."""
    code = (
        "import torch; from torch import nn; from elastic_train.api import fit\n"
        "def mean_loss(out, y): return nn.functional.cross_entropy(out, y)\n"
        "fit(model=nn.Linear(4, 2), dataset=[(torch.zeros(4), 0)] * 8, loss=mean_loss, argv=["
        f"'--checkpoint.dir={tmp_path}', '--training.steps=2'])\n"
    )
    done = run_code(code, [])
    assert done.returncode == EXIT_CONFIG_ERROR, done.stderr[-2000:]
    assert "fit(loss=mean_loss) (model.loss_form = 'per_sample')" in done.stderr
    assert "one loss per sample" in done.stderr
    assert not list(tmp_path.glob("step-*"))  # nothing trained, nothing saved


def _migration_diff() -> str:
    """The unified diff of the two examples without their module docstrings."""
    import ast
    import difflib

    def body(path: Path) -> list[str]:
        text = path.read_text()
        return text.splitlines()[ast.parse(text).body[0].end_lineno :]

    examples = Path(__file__).resolve().parents[1] / "examples"
    before = body(examples / "ddp_migration" / "before_ddp_tutorial.py")
    after = body(examples / "own_script" / "my_train.py")
    lines = difflib.unified_diff(
        before, after, "before_ddp_tutorial.py", "own_script/my_train.py", lineterm="", n=2
    )
    return "\n".join(lines)


def test_the_migration_diff_in_the_docs_is_the_examples_diff() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    start = doc.index("<!-- diff: examples/ddp_migration/before_ddp_tutorial.py")
    block = doc[start:].split("```diff\n", 1)[1].split("\n```", 1)[0]
    assert block == _migration_diff()


def test_local_refuses_a_missing_script_before_starting_anything(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "elastic_train.cli", "local", "--script", str(tmp_path / "no.py"),
         "--run-dir", str(run_dir), "--quiet"],
        env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"--script '{tmp_path / 'no.py'}': no such file" in done.stderr
    assert not run_dir.exists()  # no etcd, no agent, no run directory


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    """The script's model is not in the config: its layout is in the fingerprint."""
    code = (
        "import sys, torch; from torch import nn; from elastic_train.api import fit\n"
        "width = int(sys.argv[1])\n"
        "fit(model=nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2)),\n"
        "    dataset=[(torch.randn(4), i % 2) for i in range(16)],\n"
        "    loss=nn.CrossEntropyLoss(reduction='none'), argv=sys.argv[2:])\n"
    )
    args = [f"--checkpoint.dir={tmp_path}", "--training.steps=2", "--training.global_batch_size=8"]

    def run(width: int) -> subprocess.CompletedProcess[str]:
        return run_code(code, [str(width), *args])

    first = run(8)
    assert first.returncode == 0, first.stderr[-2000:]
    assert (tmp_path / "step-000000002").is_dir()
    same = run(8)  # the same model: resumes from step 2, already done
    assert same.returncode == 0, same.stderr[-2000:]
    other = run(16)
    assert other.returncode == EXIT_CONFIG_ERROR, other.stderr[-2000:]
    assert "written under another config fingerprint" in other.stderr
