"""The Grafana dashboard: generated from code, provisioned, and every query parses."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import yaml
from prom_tools import (
    DASHBOARD,
    REPO,
    check_promql_parses,
    dashboard_annotations,
    dashboard_targets,
    needs_promtool,
    substitute,
)

GRAFANA = REPO / "deploy" / "grafana"
#: Grafana unit ids a panel may use: seconds, bytes, bytes/s, a ratio, requests/s, and
#: "suffix: <what>/s" or "suffix: <what>" for counts and rates of named things.
#: "none" is for what has no unit at all (a loss, a step number); "short" is not a unit.
UNITS = {"s", "bytes", "Bps", "percentunit", "reqps", "none"}
SUFFIX_UNIT = re.compile(r"suffix: [a-z]+(/s)?")
#: The panels whose values have no unit, and why: a loss, evaluation metrics, step numbers.
UNITLESS = {"Training loss", "Evaluation", "Global step", "Last good checkpoint step"}


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("dashboard", GRAFANA / "dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_dashboard_is_what_the_generator_writes() -> None:
    assert DASHBOARD.read_text() == _generator().render(), (
        "deploy/grafana/dashboards/elastic-train.json is stale: "
        "run python deploy/grafana/dashboard.py"
    )


def test_fixed_uid_and_every_query_uses_the_datasource_variable() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "elastic-train"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_the_issue_topics_each_have_a_panel() -> None:
    metrics_by_topic = {
        "throughput": "elastic_train_samples_total",
        "loss": "elastic_train_loss",
        "world size": "elastic_train_world_size",
        "restarts": "elastic_train_restarts_total",
        "rendezvous": "elastic_train_rendezvous_duration_seconds",
        "recovery": "elastic_train_recovery_seconds",
        "lost steps": "elastic_train_lost_steps_total",
        "checkpoint timings": "elastic_train_checkpoint_save_seconds",
        "checkpoint age": "elastic_train_checkpoint_last_good_timestamp_seconds",
        "etcd": "elastic_train_etcd_request_errors_total",
        "cpu": "elastic_train_worker_cpu_seconds_total",
        "memory": "elastic_train_worker_resident_memory_bytes",
        "gpu memory": "elastic_train_gpu_memory_allocated_bytes",
    }
    exprs = " ".join(expr for _, expr in dashboard_targets())
    missing = [topic for topic, metric in metrics_by_topic.items() if metric not in exprs]
    assert not missing


def test_queries_only_use_known_variables() -> None:
    for title, expr in dashboard_targets():
        leftover = re.findall(r"\$\w+", substitute(expr))
        assert not leftover, f"{title}: unknown variables {leftover} in {expr}"


@needs_promtool
def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    check_promql_parses([substitute(expr) for _, expr in dashboard_targets()], tmp_path)


def test_provisioning_points_at_the_dashboards_and_prometheus() -> None:
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/elastic-train.yml").read_text())
    assert provider["apiVersion"] == 1
    assert provider["providers"][0]["type"] == "file"
    assert provider["providers"][0]["options"]["path"]
    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")


def _panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_every_panel_has_a_unit() -> None:
    for panel in _panels():
        unit = panel["fieldConfig"]["defaults"].get("unit")
        assert unit in UNITS or (unit and SUFFIX_UNIT.fullmatch(unit)), (panel["title"], unit)
        assert (unit == "none") == (panel["title"] in UNITLESS), (panel["title"], unit)
        assert panel["fieldConfig"]["overrides"] == [], "one unit per panel, no overrides"


def _expected_unit(expr: str) -> str | None:
    """The unit a query's metric names imply, where they imply one."""
    if re.search(r"rate\(\w+_errors_total", expr):
        return "suffix: errors/s"  # its "or 0 * requests" only fills the gaps with 0
    if "_cpu_seconds_total" in expr:
        return "percentunit"  # CPU seconds per second
    if re.search(r"_bytes_total\b", expr):
        return "Bps"
    if re.search(r"_bytes\{", expr):
        return "bytes"
    if re.search(r"_seconds_(bucket|sum)\{", expr) or expr.startswith("time() -"):
        return "s"
    if re.search(r"_seconds_count\{", expr) and "rate(" in expr:
        return "reqps"  # a histogram's count: observations (requests) per second
    if "rate(elastic_train_samples_total" in expr:
        return "suffix: samples/s"
    if "rate(elastic_train_steps_total" in expr:
        return "suffix: steps/s"
    return None


def test_each_panel_unit_matches_every_query_in_it() -> None:
    """No panel mixes units: each query's metric implies the panel's unit."""
    checked = 0
    for panel in _panels():
        unit = panel["fieldConfig"]["defaults"]["unit"]
        for item in panel["targets"]:
            expected = _expected_unit(item["expr"])
            if expected is not None:
                checked += 1
                assert unit == expected, (panel["title"], item["expr"], unit)
    assert checked >= 12


def test_restarts_and_recoveries_are_annotations_driven_by_metrics() -> None:
    board = json.loads(DASHBOARD.read_text())
    by_name = {a["name"]: a for a in board["annotations"]["list"]}
    expected = {
        "Worker restarts": "elastic_train_restarts_total",
        "Recoveries": "elastic_train_recovery_seconds_count",
    }
    for name, metric in expected.items():
        item = by_name[name]
        assert item["enable"] and item["datasource"]["uid"] == "${datasource}"
        assert item["expr"] == item["target"]["expr"] and metric in item["expr"]
        assert "{{node}}" in item["textFormat"] and item["tagKeys"] == "node"
    assert set(dashboard_annotations()) == set(expected)


@needs_promtool
def test_every_annotation_query_parses(tmp_path: Path) -> None:
    check_promql_parses([substitute(e) for e in dashboard_annotations().values()], tmp_path)
