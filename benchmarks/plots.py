"""PNG plots of the results (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on CI or servers

import matplotlib.pyplot as plt


def _bars(ax: Any, summary: dict[str, Any], metric: str, ylabel: str) -> None:
    """Median bars with min-max whiskers, one per competitor that has a value."""
    names = [n for n, e in summary.items() if e[metric]["median"] is not None]
    med = [summary[n][metric]["median"] for n in names]
    low = [m - summary[n][metric]["min"] for n, m in zip(names, med, strict=True)]
    high = [summary[n][metric]["max"] - m for n, m in zip(names, med, strict=True)]
    ax.bar(names, med, yerr=[low, high], capsize=4, color="tab:blue")
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", rotation=30)
    missing = [n for n in summary if n not in names]
    if missing:
        ax.set_title(f"no value: {', '.join(missing)}", fontsize=8)


def event(result: dict[str, Any], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    _bars(left, result["summary"], "seconds", "event -> first step, s")
    _bars(right, result["summary"], "lost_steps", "lost steps")
    fig.suptitle(result["benchmark"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def single(metric: str, ylabel: str) -> Any:
    def draw(result: dict[str, Any], path: Path) -> None:
        fig, ax = plt.subplots(figsize=(8, 4))
        _bars(ax, result["summary"], metric, ylabel)
        fig.suptitle(result["benchmark"])
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    return draw


def scale(result: dict[str, Any], path: Path) -> None:
    ks = sorted(result["by_agents"], key=int)
    names = list(result["by_agents"][ks[0]]["summary"])

    def series(name: str, metric: str) -> list[tuple[int, float]]:
        points = [(int(k), result["by_agents"][k]["summary"][name][metric]["median"]) for k in ks]
        return [(k, v) for k, v in points if v is not None]

    panels = (("round_seconds", "round, s"), ("rerendezvous_seconds", "re-rendezvous, s"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (metric, label) in zip(axes, panels, strict=False):
        for name in names:
            if points := series(name, metric):
                ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set_ylabel(label)
    for name in names:
        # etcd's own request count where there is one; the c10d store has none,
        # so its backend calls (one store request each) stand in, labelled so.
        points = series(name, "idle_requests_per_agent_per_s")
        label = name
        if not points:
            points, label = series(name, "backend_calls_per_agent_per_s"), f"{name} (store calls)"
        if points:
            axes[2].plot(*zip(*points, strict=True), marker="o", label=label)
    axes[2].set_ylabel("idle requests/s per agent")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("agents K")
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.suptitle(result["benchmark"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


DRAW = {
    "recovery": event,
    "scaleup": event,
    "preemption": event,
    "throughput": single("samples_per_second", "samples/s"),
    "checkpoint_cost": single("samples_per_second", "samples/s"),
    "rendezvous_scale": scale,
}


def draw_all(
    results: dict[str, dict[str, Any]], directory: Path, *, suffix: str = ""
) -> list[Path]:
    """One PNG per benchmark, ``{directory}/{name}{suffix}.png``; returns the paths."""
    paths = []
    for name, result in results.items():
        path = directory / f"{name}{suffix}.png"
        DRAW[name](result, path)
        paths.append(path)
    return paths
