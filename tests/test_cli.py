"""``elastic-train``: argument errors, and Ctrl-C on a real local cluster."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from elastic_train.cli import EXIT_USAGE, main


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
    ],
)
def test_bad_arguments_fail_before_anything_starts(
    args: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code = main(["local", "--run-dir", str(tmp_path), "--quiet", *args])
    assert code == EXIT_USAGE
    assert named in capsys.readouterr().err
    assert _no_run_started(tmp_path)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_the_chaos_error_lists_the_accepted_forms(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["local", "--quiet", "--chaos", "kill1@20s"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "'kill1@20s'" in err and "KIND:NODE@SECONDSs" in err and "stepN" in err


def test_a_subcommand_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == EXIT_USAGE
    assert "local" in capsys.readouterr().err
