"""Generates dashboards/elastic-train.json: ``python deploy/grafana/dashboard.py``.

The dashboard is code so that every panel follows the same conventions (the
``${datasource}`` variable, ``$job``/``$node`` filters, units) and a test can
check that the committed JSON is what this file generates.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

UID = "elastic-train"
OUTPUT = Path(__file__).with_name("dashboards") / "elastic-train.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job",node=~"$node"'
JOB = 'job=~"$job"'
# Checkpoints, rendezvous and recoveries are rare events: average them over a
# window wide enough to hold some, not over $__rate_interval.
WINDOW = "10m"
# Annotations: a window wider than two scrapes at the shipped 10 s interval
# (deploy/prometheus/prometheus.yml, the PodMonitor), so no change is missed.
EVENT_WINDOW = "30s"
EVENT_STEP = "10s"


def mean(metric: str, by: str = "node", window: str = WINDOW) -> str:
    """Mean of a histogram's observations over ``window``."""
    return (
        f"sum by ({by}) (increase({metric}_sum{{{SEL}}}[{window}]))"
        f" / sum by ({by}) (increase({metric}_count{{{SEL}}}[{window}]))"
    )


def event(counter: str) -> str:
    """Per node, whether ``counter`` changed in the last :data:`EVENT_WINDOW`.

    ``changes()`` rather than ``increase()``: it counts a counter's steps exactly,
    without extrapolation, and a new agent's counter starting from 0 again is
    not an event. Every such series exists from its process's start (at 0), so
    the first event is a change too.
    """
    return f"sum by (node) (changes({counter}{{{SEL}}}[{EVENT_WINDOW}])) > 0"


def annotation(name: str, counter: str, *, text: str, color: str) -> dict[str, Any]:
    """A Prometheus-driven annotation: a region from each change of ``counter`` onward.

    Grafana joins the consecutive steps at which the query returns a series
    into one region, so an event shows as a band :data:`EVENT_WINDOW` wide
    starting at the first evaluation step after it.
    """
    expr = event(counter)
    return {
        "name": name,
        "datasource": DATASOURCE,
        "enable": True,
        "hide": False,
        "iconColor": color,
        "expr": expr,
        "step": EVENT_STEP,
        "titleFormat": name,
        "textFormat": text,
        "tagKeys": "node",
        "useValueForTime": False,
        "target": {"refId": "Anno", "expr": expr, "interval": EVENT_STEP},
    }


def annotations() -> list[dict[str, Any]]:
    return [
        annotation("Worker restarts", "elastic_train_restarts_total", color="orange",
                   text="{{node}}: worker group restarted (a new rendezvous round)"),
        annotation("Recoveries", "elastic_train_recovery_seconds_count", color="green",
                   text="{{node}}: first step after a recovery (seconds in Recovery time)"),
    ]  # fmt: skip


def quantile(q: float, metric: str, by: str = "") -> str:
    labels = f"le, {by}" if by else "le"
    return (
        f"histogram_quantile({q}, sum by ({labels}) "
        f"(rate({metric}_bucket{{{SEL}}}[$__rate_interval])))"
    )


def rate(metric: str, by: str = "node") -> str:
    return f"sum by ({by}) (rate({metric}{{{SEL}}}[$__rate_interval]))"


def target(expr: str, legend: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ""}


def panel(
    title: str,
    targets: list[dict[str, Any]],
    *,
    unit: str,
    kind: str = "timeseries",
    width: int = 12,
    description: str = "",
) -> dict[str, Any]:
    for ref, item in enumerate(targets):
        item["refId"] = chr(ord("A") + ref)
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "gridPos": {"h": 4 if kind == "stat" else 8, "w": width, "x": 0, "y": 0},
        "options": {},
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {}}


def panels() -> list[dict[str, Any]]:
    return [*_overview(), *_training(), *_elasticity(), *_checkpoints(), *_etcd(), *_resources()]


def _overview() -> list[dict[str, Any]]:
    ckpt_time = "elastic_train_checkpoint_last_good_timestamp_seconds"
    return [
        panel("Global step", [target(f"max(elastic_train_global_step{{{JOB}}})", "step")],
              kind="stat", unit="none", width=6),
        panel("World size", [target(f"max(elastic_train_world_size{{{JOB}}})", "workers")],
              kind="stat", unit="suffix: workers", width=6),
        panel("Samples / s",
              [target(f"sum(rate(elastic_train_samples_total{{{JOB}}}[$__rate_interval]))",
                      "samples/s")],
              kind="stat", unit="suffix: samples/s", width=6),
        panel("Checkpoint age",
              [target(f"time() - max({ckpt_time}{{{JOB}}})", "age")],
              kind="stat", unit="s", width=6),
    ]  # fmt: skip


def _training() -> list[dict[str, Any]]:
    return [
        row("Training"),
        panel("Samples / s per node",
              [target(rate("elastic_train_samples_total"), "{{node}}")], unit="suffix: samples/s"),
        panel("Steps / s",
              [target(f"sum(rate(elastic_train_steps_total{{{JOB}}}[$__rate_interval]))",
                      "steps/s")],
              unit="suffix: steps/s"),
        panel("Training loss",
              [target(f"max by (node) (elastic_train_loss{{{SEL}}})", "{{node}}")],
              unit="none", width=8, description="The global batch's mean loss: no unit."),
        panel("Step duration",
              [target(quantile(0.5, "elastic_train_step_duration_seconds"), "p50"),
               target(quantile(0.95, "elastic_train_step_duration_seconds"), "p95")],
              unit="s", width=8),
        panel("Evaluation",
              [target(f"max by (metric) (elastic_train_eval_metric{{{SEL}}})", "{{metric}}")],
              unit="none", width=8, description="Evaluation metrics as the job names them."),
    ]  # fmt: skip


def _elasticity() -> list[dict[str, Any]]:
    return [
        row("Elasticity"),
        panel("World size over time",
              [target(f"max by (node) (elastic_train_world_size{{{SEL}}})", "{{node}}")],
              unit="suffix: workers",
              description="Workers in the group each node sees; 0 while it is between rounds."),
        panel("Nodes in the round",
              [target(f"max(elastic_train_nodes{{{JOB}}})", "nodes in round"),
               target(f"max(elastic_train_min_nodes{{{JOB}}})", "min nodes")],
              unit="suffix: nodes"),
        panel("Restarts and in-process re-forms",
              [target(f"max by (node) (elastic_train_restarts_total{{{SEL}}})",
                      "{{node}} restarts"),
               target(f"sum by (node, cause) "
                      f"(elastic_train_inprocess_regroups_total{{{SEL}}})",
                      "{{node}} in process ({{cause}})")],
              unit="suffix: events", width=8,
              description="Worker-group restarts since each agent started, and groups "
              "re-formed in place (in-process recovery) after a failure or for a join."),
        panel("Rendezvous rounds",
              [target(f"max by (node) (elastic_train_rendezvous_rounds_total{{{SEL}}})",
                      "{{node}}")],
              unit="suffix: rounds", width=8),
        panel("Rendezvous duration",
              [target(mean("elastic_train_rendezvous_duration_seconds"), "{{node}} mean"),
               target(f"sum by (node) (elastic_train_rendezvous_duration_seconds_sum{{{SEL}}})"
                      f" / sum by (node) "
                      f"(elastic_train_rendezvous_duration_seconds_count{{{SEL}}})",
                      "{{node}} mean since start")],
              unit="s", width=8,
              description=f"{WINDOW} means, and the mean since each agent started: with "
              "in-process recovery a round is rare (a node's start, a restart), so a "
              f"{WINDOW} window is often empty."),
        panel("Recovery time",
              [target(mean("elastic_train_recovery_seconds"), "{{node}} mean")],
              unit="s",
              description=f"From a recovery's start (the agent's re-rendezvous, or an "
              f"in-process re-form) to the first step after; "
              f"{WINDOW} means. Each recovery is also an annotation."),
        panel("Lost steps",
              [target(f"sum(elastic_train_lost_steps_total{{{JOB}}})", "lost steps (total)"),
               target(f"sum(increase(elastic_train_lost_steps_total{{{JOB}}}[{WINDOW}]))",
                      f"lost steps ({WINDOW})")],
              unit="suffix: steps"),
    ]  # fmt: skip


def _checkpoints() -> list[dict[str, Any]]:
    # Restores are rare (one per restart), so a windowed increase() of a series that
    # appears with its first observation is empty: show the run's cumulative mean
    # (multiprocess histograms outlive the workers).
    restore = (
        f"sum by (node, source) (elastic_train_restore_seconds_sum{{{SEL}}})"
        f" / sum by (node, source) (elastic_train_restore_seconds_count{{{SEL}}})"
    )
    return [
        row("Checkpoints"),
        panel("Checkpoint timings",
              [target(mean("elastic_train_checkpoint_blocking_seconds"), "{{node}} blocking"),
               target(mean("elastic_train_checkpoint_save_seconds"), "{{node}} save"),
               target(restore, "{{node}} restore from {{source}} (run mean)")],
              unit="s", description=f"Means over {WINDOW}."),
        panel("Checkpoint write rate",
              [target(rate("elastic_train_checkpoint_written_bytes_total", by="job"), "bytes/s")],
              unit="Bps"),
        panel("Last good checkpoint step",
              [target(f"max(elastic_train_checkpoint_last_good_step{{{JOB}}})", "step")],
              unit="none", description="A step number, not a quantity."),
        panel("Checkpoint failures",
              [target(f"sum(elastic_train_checkpoint_failures_total{{{JOB}}})", "failures")],
              unit="suffix: failures"),
    ]  # fmt: skip


def _etcd() -> list[dict[str, Any]]:
    requests = rate("elastic_train_etcd_request_duration_seconds_count", by="op")
    errors = rate("elastic_train_etcd_request_errors_total", by="op")
    return [
        row("etcd"),
        panel("etcd requests", [target(requests, "{{op}}")], unit="reqps", width=8),
        panel("etcd request latency",
              [target(quantile(0.95, "elastic_train_etcd_request_duration_seconds", by="op"),
                      "{{op}} p95")],
              unit="s", width=8),
        panel("etcd errors", [target(f"{errors} or 0 * {requests}", "{{op}}")],
              unit="suffix: errors/s", width=8),
    ]  # fmt: skip


def _resources() -> list[dict[str, Any]]:
    memory = [
        target(f"sum by (node) (elastic_train_{name}_bytes{{{SEL}}})", f"{{{{node}}}} {legend}")
        for name, legend in [("worker_resident_memory", "RSS"),
                             ("gpu_memory_allocated", "GPU allocated"),
                             ("gpu_memory_reserved", "GPU reserved")]
    ]  # fmt: skip
    return [
        row("Resources"),
        panel("CPU per node", [target(rate("elastic_train_worker_cpu_seconds_total"), "{{node}}")],
              unit="percentunit", width=8, description="CPU seconds per second: 1 = one core."),
        panel("Memory per node", memory, unit="bytes", width=8,
              description="GPU series exist only on CUDA nodes."),
        panel("Open file descriptors",
              [target(f"sum by (node) (elastic_train_worker_open_fds{{{SEL}}})", "{{node}}")],
              unit="suffix: fds", width=8),
    ]  # fmt: skip


def layout(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Left to right, wrapping at Grafana's 24 columns; rows take a line of their own."""
    x = y = line_height = 0
    for pid, item in enumerate(items, start=1):
        item["id"] = pid
        grid = item["gridPos"]
        if item["type"] == "row" or x + grid.get("w", 24) > 24:
            x, y, line_height = 0, y + line_height, 0
        if item["type"] == "row":
            item["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            y += 1
            continue
        grid.update(x=x, y=y)
        x, line_height = x + grid["w"], max(line_height, grid["h"])
    return items


def variable(name: str, query: str, *, multi: bool) -> dict[str, Any]:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-query"},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "multi": multi,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": UID,
        "title": "elastic_train",
        "description": "Elastic PyTorch training: throughput, elasticity, checkpoints, etcd.",
        "tags": ["elastic-train", "pytorch"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": annotations()},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                variable("job", "label_values(elastic_train_world_size, job)", multi=False),
                variable(
                    "node", 'label_values(elastic_train_world_size{job=~"$job"}, node)', multi=True
                ),
            ]
        },
        "panels": layout(panels()),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(render())
