"""ruff's lint rules and formatting (configured in pyproject.toml) hold for the whole tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: The Python trees; ruff also formats code blocks in Markdown, which stay as written.
PYTHON = ("elastic_train", "tests", "benchmarks", "examples", "deploy")


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is a dev dependency")
@pytest.mark.parametrize(
    "args", [("check", *PYTHON), ("format", "--check", *PYTHON)], ids=["check", "format"]
)
def test_ruff(args: tuple[str, ...]) -> None:
    result = _ruff(*args)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
