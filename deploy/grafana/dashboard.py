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
# Checkpoints, rendezvous and recoveries are rare events: average them over a
# window wide enough to hold some, not over $__rate_interval.
WINDOW = "10m"


def mean(metric: str, by: str = "node", window: str = WINDOW) -> str:
    """Mean of a histogram's observations over ``window``."""
    return (
        f"sum by ({by}) (increase({metric}_sum{{{SEL}}}[{window}]))"
        f" / sum by ({by}) (increase({metric}_count{{{SEL}}}[{window}]))"
    )


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
    unit: str = "short",
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
    job = 'job=~"$job"'
    return [
        panel(
            "Global step",
            [target(f"max(elastic_train_global_step{{{job}}})", "step")],
            kind="stat",
            width=6,
        ),
        panel(
            "World size",
            [target(f"max(elastic_train_world_size{{{job}}})", "workers")],
            kind="stat",
            width=6,
        ),
        panel(
            "Samples / s",
            [
                target(
                    f"sum(rate(elastic_train_samples_total{{{job}}}[$__rate_interval]))",
                    "samples/s",
                )
            ],
            kind="stat",
            width=6,
        ),
        panel(
            "Checkpoint age",
            [
                target(
                    f"time() - max(elastic_train_checkpoint_last_good_timestamp_seconds{{{job}}})",
                    "age",
                )
            ],
            kind="stat",
            unit="s",
            width=6,
        ),
        row("Training"),
        panel(
            "Throughput",
            [
                target(rate("elastic_train_samples_total"), "{{node}} samples/s"),
                target(
                    f"sum(rate(elastic_train_steps_total{{{job}}}[$__rate_interval]))", "steps/s"
                ),
            ],
            unit="ops",
        ),
        panel(
            "Training loss", [target(f"max by (node) (elastic_train_loss{{{SEL}}})", "{{node}}")]
        ),
        panel(
            "Step duration",
            [
                target(quantile(0.5, "elastic_train_step_duration_seconds"), "p50"),
                target(quantile(0.95, "elastic_train_step_duration_seconds"), "p95"),
            ],
            unit="s",
        ),
        panel(
            "Evaluation",
            [target(f"max by (metric) (elastic_train_eval_metric{{{SEL}}})", "{{metric}}")],
        ),
        row("Elasticity"),
        panel(
            "World size over time",
            [
                target(f"max by (node) (elastic_train_world_size{{{SEL}}})", "{{node}} workers"),
                target(f"max(elastic_train_nodes{{{job}}})", "nodes in round"),
                target(f"max(elastic_train_min_nodes{{{job}}})", "min nodes"),
            ],
            description="0 while a node is between rendezvous rounds.",
        ),
        panel(
            "Restarts and rendezvous rounds",
            [
                target(
                    f"max by (node) (elastic_train_restarts_total{{{SEL}}})", "{{node}} restarts"
                ),
                target(
                    f"max by (node) (elastic_train_rendezvous_rounds_total{{{SEL}}})",
                    "{{node}} rounds",
                ),
                target(
                    mean("elastic_train_rendezvous_duration_seconds"), "{{node}} mean rendezvous s"
                ),
            ],
            description=f"Counters since each agent started; durations are {WINDOW} means.",
        ),
        panel(
            "Recovery time",
            [
                target(mean("elastic_train_recovery_seconds"), "{{node}} mean"),
                target(
                    f"max by (node) (elastic_train_recovery_seconds_count{{{SEL}}})",
                    "{{node}} recoveries",
                ),
            ],
            unit="s",
            description="From the agent starting to recover to the first step after.",
        ),
        panel(
            "Lost steps",
            [
                target(f"sum(elastic_train_lost_steps_total{{{job}}})", "lost steps (total)"),
                target(
                    f"sum(increase(elastic_train_lost_steps_total{{{job}}}[{WINDOW}]))",
                    f"lost steps ({WINDOW})",
                ),
            ],
        ),
        row("Checkpoints"),
        panel(
            "Checkpoint timings",
            [
                target(mean("elastic_train_checkpoint_blocking_seconds"), "{{node}} blocking"),
                target(mean("elastic_train_checkpoint_save_seconds"), "{{node}} save"),
                # Restores are rare (one per restart), so a windowed increase() of a
                # series that appears with its first observation is empty: show the
                # run's cumulative mean (multiprocess histograms outlive the workers).
                target(
                    f"sum by (node, source) (elastic_train_restore_seconds_sum{{{SEL}}})"
                    f" / sum by (node, source) (elastic_train_restore_seconds_count{{{SEL}}})",
                    "{{node}} restore from {{source}} (run mean)",
                ),
            ],
            unit="s",
            description=f"Means over {WINDOW}.",
        ),
        panel(
            "Checkpoint progress",
            [
                target(f"max(elastic_train_checkpoint_last_good_step{{{job}}})", "last good step"),
                target(rate("elastic_train_checkpoint_written_bytes_total", by="job"), "bytes/s"),
                target(f"sum(elastic_train_checkpoint_failures_total{{{job}}})", "failures"),
            ],
        ),
        row("etcd"),
        panel(
            "etcd requests",
            [
                target(
                    rate("elastic_train_etcd_request_duration_seconds_count", by="op"), "{{op}}"
                ),
                target(
                    quantile(0.95, "elastic_train_etcd_request_duration_seconds", by="op"),
                    "{{op}} p95 s",
                ),
            ],
            unit="short",
        ),
        panel(
            "etcd errors",
            [
                target(
                    rate("elastic_train_etcd_request_errors_total", by="op")
                    + " or 0 * "
                    + rate("elastic_train_etcd_request_duration_seconds_count", by="op"),
                    "{{op}} errors/s",
                )
            ],
            unit="short",
        ),
        row("Resources"),
        panel(
            "CPU per node",
            [target(rate("elastic_train_worker_cpu_seconds_total"), "{{node}}")],
            unit="percentunit",
            width=8,
        ),
        panel(
            "Memory per node",
            [
                target(
                    f"sum by (node) (elastic_train_worker_resident_memory_bytes{{{SEL}}})",
                    "{{node}} RSS",
                ),
                target(
                    f"sum by (node) (elastic_train_gpu_memory_allocated_bytes{{{SEL}}})",
                    "{{node}} GPU allocated",
                ),
                target(
                    f"sum by (node) (elastic_train_gpu_memory_reserved_bytes{{{SEL}}})",
                    "{{node}} GPU reserved",
                ),
            ],
            unit="bytes",
            width=8,
            description="GPU series exist only on CUDA nodes.",
        ),
        panel(
            "Open file descriptors",
            [target(f"sum by (node) (elastic_train_worker_open_fds{{{SEL}}})", "{{node}}")],
            width=8,
        ),
    ]


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
        "annotations": {"list": []},
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
