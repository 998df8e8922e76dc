"""Helpers for the Prometheus and Grafana tests: the real promtool and prometheus binaries."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "rules" / "elastic_train.rules.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "elastic-train.json"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")

_MISSING = "needs the {} binary: install Debian's 'prometheus' package (.ci/run does)"
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=_MISSING.format("promtool"))
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None, reason=_MISSING.format("prometheus and promtool")
)


def promtool(*args: str, cwd: Path = REPO, stdin: str | None = None) -> str:
    """Run promtool; a failure shows its output."""
    proc = subprocess.run(
        [str(PROMTOOL), *args], cwd=cwd, input=stdin, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"promtool {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout + proc.stderr


def dashboard_targets() -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every query of every panel of the dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels if p["type"] != "row" for t in p["targets"]]


def dashboard_annotations() -> dict[str, str]:
    """``{annotation name: expr}`` of the dashboard's Prometheus-driven annotations."""
    board = json.loads(DASHBOARD.read_text())
    return {a["name"]: a["expr"] for a in board["annotations"]["list"] if "expr" in a}


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def substitute(expr: str, *, job: str = ".+", rate_interval: str = "1m") -> str:
    """A Grafana query with its variables replaced, as Grafana would send it."""
    return (
        expr.replace("$__rate_interval", rate_interval).replace("$job", job).replace("$node", ".*")
    )


def check_promql_parses(exprs: list[str], directory: Path) -> None:
    """promtool parses each expression (as a recording rule) or names the bad one."""
    rules = [{"record": f"check:expr_{i}", "expr": expr} for i, expr in enumerate(exprs)]
    path = directory / "exprs.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "exprs", "rules": rules}]}))
    promtool("check", "rules", str(path))


class Prometheus:
    """A real Prometheus server on loopback, for the duration of a ``with`` block."""

    def __init__(self, config: dict[str, Any], directory: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.directory = directory
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._args = [
            str(PROMETHEUS),
            f"--config.file={directory / 'prometheus.yml'}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        self.process: subprocess.Popen[bytes] | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[Prometheus]:
        with open(self.directory / "prometheus.log", "wb") as log:
            self.process = subprocess.Popen(self._args, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: self._ready(), timeout=30, what="prometheus ready")
            yield self
        finally:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _ready(self) -> bool:
        assert self.process is not None and self.process.poll() is None, "prometheus exited"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, *, at: float) -> list[dict[str, Any]]:
        return self.api("query", query=expr, time=at)["result"]

    def query_range(self, expr: str, *, start: float, end: float, step: float = 1.0) -> list:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]


def wait_for(condition: Any, *, timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll ``condition`` until it returns something truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
