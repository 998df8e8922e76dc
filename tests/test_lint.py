"""ruff's lint rules and formatting (configured in pyproject.toml) hold for the whole tree,
and one rule ruff cannot check: no ``preexec_fn``."""

from __future__ import annotations

import ast
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


def test_no_preexec_fn() -> None:
    """No ``preexec_fn`` (ruff's PLW1509 sees only ``Popen``'s): it runs Python in a
    plain fork of the caller. Ours hold gRPC channels (etcd), and gRPC restarts its
    poller thread in the child, which aborts it once subprocess closes the inherited
    descriptors (measured: 3 of 200 launches; tests/test_bad_input.py, the zygote's
    ``fork_early``)."""
    found = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for tree in PYTHON
        for path in sorted((REPO / tree).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.keyword) and node.arg == "preexec_fn"
    ]
    assert not found, found
