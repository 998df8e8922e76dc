"""Prometheus configuration and rules, checked by the real promtool and server."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
import torch
import yaml
from chaos_runs import log_events
from prom_tools import (
    PROMETHEUS_DIR,
    RULES,
    Prometheus,
    check_promql_parses,
    dashboard_annotations,
    dashboard_targets,
    needs_prometheus,
    needs_promtool,
    promtool,
    rule_exprs,
    substitute,
    wait_for,
)
from steered_runs import Pace, RejoinWatch
from torch_support import needs_inprocess

from elastic_train.etcd.server import free_port
from elastic_train.local.chaos import parse_schedule
from elastic_train.local.cluster import ClusterSpec
from elastic_train.local.runner import Summary, run_local

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


# ---------------------------------------------------------------- live: a 2-node run


def _consecutive_free_ports() -> int:
    """A port p with p + 1 free too: the runner gives node i ``metrics_port + i``."""
    for _ in range(50):
        base = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise AssertionError("no two consecutive free ports")


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _scrape_or_empty(port: int) -> str:
    try:
        return _scrape(port)
    except OSError:
        return ""


def _has_data(result: list[dict]) -> bool:
    return any(not math.isnan(float(v)) for series in result for _, v in series["values"])


def _dipped_and_recovered(values: list[float], full: float) -> bool:
    """``full``, then less, then ``full`` again."""
    first = values.index(full) if full in values else len(values)
    dip = next((i for i in range(first, len(values)) if values[i] < full), len(values))
    return full in values[dip:]


def _check_logged_events(path: Path, mode: str) -> None:
    """The node's real JSON log: named events carry the context bound in their process,
    and the world sizes node0 trained at are those of the recovery ``mode``."""
    events: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            events.setdefault(event["event"], []).append(event)
    worker_keys = {"run_id", "node", "rank", "local_rank", "world_size", "restart"}
    for name, keys in [
        ("rendezvous_joined", {"run_id", "node"}),  # the agent
        ("metrics_endpoint_started", {"run_id", "node"}),
        ("resumed", worker_keys),
        # The node agent writes them (checkpoint.writer "auto"): its own context, and the
        # world size the state was saved at.
        ("checkpoint_saved", {"run_id", "node", "world_size"}),
    ]:
        assert name in events, f"no {name} event in {path}"
        for event in events[name]:
            assert keys <= event.keys() and event["node"] == "node0", event
    assert any("rank" not in e for e in events["checkpoint_saved"]), "the agent wrote none"
    assert {e["mode"] for e in events["recovery_mode"]} == {mode}
    if mode == "restart":
        assert [e["world_size"] for e in events["resumed"]] == [2, 1, 2]  # start, kill, join
    else:  # node0 started once, then re-formed its group after the kill and for the join
        assert [e["world_size"] for e in events["resumed"]] == [2]
        assert [e["world_size"] for e in events["inprocess_recovered"]] == [1]
        assert [e["world_size"] for e in events["inprocess_admitted"]] == [2]


def _annotation_regions(
    prom: Prometheus, expr: str, *, node: str, start: float, end: float
) -> list[tuple[float, float, float]]:
    """``(first, last, max value)`` of each run of consecutive 1 s steps at which the
    annotation query returns ``node``: the regions Grafana would draw."""
    result = prom.query_range(substitute(expr, job=JOB), start=start, end=end)
    points = [(float(t), float(v)) for series in result if series["metric"]["node"] == node
              for t, v in series["values"]]  # fmt: skip
    regions: list[tuple[float, float, float]] = []
    for t, v in sorted(points):
        if regions and t - regions[-1][1] <= 1.5:
            first, _, peak = regions[-1]
            regions[-1] = (first, t, max(peak, v))
        else:
            regions.append((t, t, v))
    return regions


def _check_annotations(
    prom: Prometheus, summary: Summary, *, mode: str, start: float, end: float
) -> None:
    """The restart and recovery annotations show node0's restarts and recoveries, when
    they happened: none before the kill, the first one right after it, and together
    (a query's value counts the changes in its window) as many as the run had. In
    process, node0's workers never restart after the kill: only the recoveries are
    drawn. (Its first round may close before node1's agent is up, on a loaded box;
    the restart for node1 then comes before training starts, and its annotation,
    10 s wide, can reach past the kill: so the counter itself is compared.)"""
    kill, join = (e.time for e in summary.events if e.delivered)
    recoveries = [r for r in summary.recoveries if r.seconds is not None]
    assert len(recoveries) == 2, summary.recoveries
    exprs = dashboard_annotations()
    expected = [("Recoveries", recoveries[0].seconds + 10)]
    if mode == "restart":
        expected.append(("Worker restarts", 10.0))
    else:
        counter = f'elastic_train_restarts_total{{job="{JOB}",node="node0"}}'
        series = prom.query_range(counter, start=kill - 1, end=end)
        values = {float(v) for one in series for _, v in one["values"]}
        assert len(values) == 1, series  # scraped, and never higher than before the kill
    for name, within in expected:
        regions = _annotation_regions(prom, exprs[name], node="node0", start=start, end=end)
        assert regions, f"no {name} annotation"
        # A scrape's timestamp is its start, so a change can carry one up to 1 s early.
        assert kill - 1 <= regions[0][0] <= kill + within, (name, kill, regions)
        assert sum(peak for _, _, peak in regions) >= 2, (name, kill, join, regions)


JOB = "elastic-train"
#: Each step takes at least 0.1 s (tests/steered_model.py), so the 75 steps after the
#: join trigger leave the joiner 7.5 s or more to start and rejoin before the end,
#: however fast the machine trains the tiny MLP. Once the rejoined world has trained
#: (and been scraped) for REJOINED_S, the steps left run unpaced.
TRAINER = (
    "--model.name=tests.steered_model:steered", "--data.name=synthetic", "--training.steps=90",
    "--checkpoint.interval_steps=5", "--eval.every_steps=10", "--logging.log_every_steps=20",
)  # fmt: skip
PAUSE_S, REJOINED_S = 0.1, 4.0


def _unpace_once_rejoined(audit: Path, pace: Pace, runner: threading.Thread) -> None:
    """Set the pause to none once both nodes have trained again for ``REJOINED_S``."""
    watch = RejoinWatch(audit, nodes=2)
    rejoined: float | None = None
    while runner.is_alive():
        if rejoined is None and watch.poll():
            rejoined = time.monotonic()
        if rejoined is not None and time.monotonic() - rejoined >= REJOINED_S:
            pace.set(0.0)
            return
        time.sleep(0.25)


def _check_recovery_counters(
    prom: Prometheus, mode: str, *, start: float, end: float, kill: float | None
) -> None:
    """node0's restarts (the restart path) or its in-process re-forms went up by the
    kill and the join, the other stayed where it was, and its count of nodes (set by
    the agent's rounds, or in process by the re-forms) dipped and recovered. ``kill``:
    when node0's worker noticed the kill (in process)."""

    def node0(series: str, since: float = start) -> dict[str, list[float]]:
        result = prom.query_range(f'{series}{{job="{JOB}",node="node0"}}', start=since, end=end)
        return {r["metric"].get("cause", ""): [float(v) for _, v in r["values"]] for r in result}

    (nodes,) = node0("elastic_train_nodes").values()
    assert _dipped_and_recovered(nodes, 2.0), nodes
    restarts = node0("elastic_train_restarts_total")[""]
    regroups = node0("elastic_train_inprocess_regroups_total")
    if mode == "restart":
        # The first scrape may already see a restart: a node that reached the first
        # rendezvous late joins by a restart.
        assert restarts[-1] >= restarts[0] + 2, restarts
        assert all(values[-1] == 0 for values in regroups.values()), regroups
    else:
        # Not a restart from the kill on. One before it is the late-first-round
        # restart above (min_nodes=1: node0 may start alone and take node1 in).
        assert kill is not None
        since_kill = node0("elastic_train_restarts_total", since=kill - 1.0)[""]
        assert since_kill[-1] == since_kill[0] and restarts[-1] <= 1, (since_kill, restarts)
        assert {cause: values[-1] for cause, values in regroups.items()} == {
            "failure": 1, "join": 1, "preemption": 0}, regroups  # fmt: skip


def _noticed_kill(tmp_path: Path) -> float:
    """When node0's worker noticed node1's kill (in process), as a Unix time."""
    events = log_events(tmp_path / "run" / "logs" / "node0.log", "inprocess_recovery_started")
    stamps = [datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")) for e in events]
    assert stamps, "node0 logged no in-process recovery"
    return min(stamps).timestamp()


@needs_prometheus
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["restart", pytest.param("inprocess", marks=needs_inprocess)])
def test_live_two_node_run_fills_the_dashboard_and_survives_a_kill(
    tmp_path: Path, mode: str
) -> None:
    """A real `elastic-train local` run (2 nodes, node1 killed and rejoining) scraped by a
    real Prometheus: every panel has data, restarts (or, in process, re-forms) went up,
    the world size dipped and recovered, and no counter of the surviving node ever went
    backwards. ``inprocess`` is the default ``elastic.recovery = "auto"``."""
    base = _consecutive_free_ports()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": JOB,
                "static_configs": [{"targets": [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]}],
            }
        ],
    }
    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    pace = Pace(tmp_path / "pause", PAUSE_S)
    spec = ClusterSpec(
        nodes=2, min_nodes=1, chaos=parse_schedule("kill:1@step10,join:1@step15"),
        script_args=(*TRAINER, f"--model.options.pause_file={pace.path}",
                     *(["--elastic.recovery=restart"] if mode == "restart" else [])),
        metrics_port=base,
        timeout_s=400,
    )  # fmt: skip
    with Prometheus(config, prom_dir, free_port()).running() as prom:
        start = time.time()
        summaries: list = []
        runner = threading.Thread(
            target=lambda: summaries.append(
                run_local(spec, run_dir=tmp_path / "run", timeline=False)
            )
        )
        runner.start()
        try:
            live = wait_for(
                lambda: (text := _scrape_or_empty(base)) and "elastic_train_global_step" in text,
                timeout=120,
                what="node0's endpoint to show training",
            )
            for text in (_scrape(base), _scrape_or_empty(base + 1) or live):
                promtool("check", "metrics", stdin=text)
            _unpace_once_rejoined(tmp_path / "run" / "audit", pace, runner)
        finally:
            runner.join()
        end = time.time()
        (summary,) = summaries
        assert summary.completed, summary.error
        _check_logged_events(tmp_path / "run" / "logs" / "node0.log", mode)
        wait_for(lambda: prom.query("up", at=end), timeout=10, what="scrapes stored")

        # A panel has data when one of its queries has (in process, the rendezvous
        # panel's window mean is empty: no round after the first).
        empty: dict[str, list[str]] = {}
        filled: set[str] = set()
        for title, expr in dashboard_targets():
            if "gpu_memory" in expr and not torch.cuda.is_available():
                continue  # CPU-only machine: no GPU series exist (the panel shows RSS)
            query = substitute(expr, job=JOB, rate_interval="10s")
            if _has_data(prom.query_range(query, start=start, end=end)):
                filled.add(title)
            else:
                empty.setdefault(title, []).append(query)
        assert empty.keys() <= filled, {t: q for t, q in empty.items() if t not in filled}

        rules = prom.api("rules")["groups"]
        unhealthy = [r["name"] for g in rules for r in g["rules"] if r["health"] != "ok"]
        assert not unhealthy

        kill = _noticed_kill(tmp_path) if mode == "inprocess" else None
        _check_recovery_counters(prom, mode, start=start, end=end, kill=kill)
        world = prom.query_range(f'max(elastic_train_world_size{{job="{JOB}"}})', start=start,
                                 end=end)  # fmt: skip
        sizes = [float(v) for _, v in world[0]["values"]]
        assert _dipped_and_recovered(sizes, 2.0), sizes
        _check_annotations(prom, summary, mode=mode, start=start, end=end)

        window = f"{int(end - start) + 5}s"
        counters = [
            name
            for name in prom.api("label/__name__/values")
            if name.startswith("elastic_train_") and name.endswith(("_total", "_count", "_sum"))
        ]
        assert "elastic_train_samples_total" in counters
        for name in counters:
            for series in prom.query(f'resets({name}{{job="{JOB}"}}[{window}])', at=end):
                node, resets = series["metric"]["node"], float(series["value"][1])
                # node1's agent was killed: its new agent starts from zero, once
                assert resets <= (1 if node == "node1" else 0), (name, series["metric"])
