"""Prometheus configuration and rules, checked by the real promtool and server."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prom_tools import (
    PROMETHEUS_DIR,
    RULES,
    check_promql_parses,
    needs_promtool,
    promtool,
    rule_exprs,
)

pytestmark = pytest.mark.prometheus

RULE_TESTS = PROMETHEUS_DIR / "tests" / "elastic_train.test.yml"
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600}


def _seconds(duration: str) -> int:
    """A promtool duration such as ``85m`` or ``1h`` (one unit)."""
    return int(duration[:-1]) * _UNIT_SECONDS[duration[-1]]


@needs_promtool
def test_promtool_check_config() -> None:
    assert "SUCCESS" in promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))


@needs_promtool
def test_promtool_check_rules(tmp_path: Path) -> None:
    promtool("check", "rules", str(RULES))
    check_promql_parses(rule_exprs(), tmp_path)


@needs_promtool
def test_promtool_test_rules() -> None:
    assert "SUCCESS" in promtool("test", "rules", str(RULE_TESTS), cwd=RULE_TESTS.parent)


def test_rule_tests_fire_and_clear_every_alert() -> None:
    alerts = {
        rule["alert"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    fired: set[str] = set()
    cleared_after_firing: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in sorted(
            case.get("alert_rule_test", []), key=lambda c: _seconds(c["eval_time"])
        ):
            name = check["alertname"]
            if check["exp_alerts"]:
                fired.add(name)
            elif name in fired:
                cleared_after_firing.add(name)
    assert alerts == fired == cleared_after_firing
    assert {"ElasticTrainStalled", "ElasticTrainRestartStorm", "ElasticTrainBelowMinNodes",
            "ElasticTrainCheckpointTooOld", "ElasticTrainCheckpointFailures",
            "ElasticTrainEtcdErrors"} <= alerts  # fmt: skip
