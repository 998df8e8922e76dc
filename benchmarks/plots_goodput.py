"""The goodput soak's figure (``benchmarks.goodput``), in the style of ``plots``:
goodput per event interval and cumulative goodput over the window, one line per
competitor, every kill and rejoin marked where it happened."""

from __future__ import annotations

from itertools import accumulate
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from benchmarks.plots import OTHER_COLORS, OTHER_LINESTYLES, OURS_COLOR

KILL_COLOR, JOIN_COLOR = "#B00000", "#009E73"


def _style(name: str, index: int) -> dict[str, Any]:
    if name == "ours":
        return {"color": OURS_COLOR, "linewidth": 2.4, "linestyle": "-", "zorder": 4}
    # Index 0 is ours; the others start at the first colour (blue, dashed), apart
    # from the events' red and green.
    other = max(0, index - 1)
    return {
        "color": OTHER_COLORS[other % len(OTHER_COLORS)],
        "linewidth": 1.6,
        "linestyle": OTHER_LINESTYLES[other % len(OTHER_LINESTYLES)],
        "zorder": 3,
    }


def _first_run(result: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The first soak of ``name`` with a goodput (the figure shows one repetition)."""
    runs = result["runs"].get(name, {}).get("runs", [])
    return next((r for r in runs if r.get("goodput") is not None), None)


def _events(ax: Axes, events: list[dict[str, Any]], *, label: bool) -> None:
    for event in events:
        kill = event["kind"] == "kill"
        ax.axvline(event["at_seconds"], color=KILL_COLOR if kill else JOIN_COLOR,
                   linestyle="--" if kill else ":", linewidth=1.0, zorder=1)  # fmt: skip
        if label:
            ax.text(event["at_seconds"], 1.01, f"{event['kind']} {event['node']}",
                    transform=ax.get_xaxis_transform(), rotation=90, fontsize=6.5,
                    ha="center", va="bottom", color="0.3")  # fmt: skip


def _series(run: dict[str, Any]) -> tuple[list[float], list[float], list[float]]:
    """Bin ends (s), goodput in each bin, cumulative goodput at each end."""
    bins, width = run["steps_per_bin"], run["bin_seconds"]
    rate = run["fault_free_steps_per_second"]
    ends = [width * (i + 1) for i in range(len(bins))]
    per = [n / width / rate for n in bins]
    cumulative = [c / end / rate for c, end in zip(accumulate(bins), ends, strict=True)]
    return ends, per, cumulative


def goodput_figure(result: dict[str, Any], title: str) -> Figure:
    """Two panels sharing the time axis: per interval (the dips) and cumulative (the total)."""
    fig = Figure(figsize=(10, 6.4))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"hspace": 0.12})
    settings = result["settings"]
    names = [n for n in result["summary"] if not n.count("-fault-free")]
    handles, totals = [], []
    highs, cum_highs, lows = [1.15], [1.05], [0.8]
    for index, name in enumerate(sorted(names, key=lambda n: n != "ours")):
        run = _first_run(result, name)
        if run is None:
            continue
        ends, per, cumulative = _series(run)
        style = _style(name, index)
        top.step([0.0, *ends], [per[0], *per], where="pre", **{**style, "linewidth": 1.2})
        bottom.plot(ends, cumulative, **style)
        highs.append(max(per) * 1.05)
        cum_highs.append(max(cumulative[len(cumulative) // 10 :]) + 0.02)
        lows.append(min(cumulative[len(cumulative) // 10 :]) - 0.02)
        handles.append(Line2D([], [], **style, label=name))  # the numbers are in the subtitle
        totals.append(f"{name} {run['goodput']:.3f}")
    for ax, label in ((top, True), (bottom, False)):
        _events(ax, settings["schedule"], label=label)
        ax.axhline(1.0, color="0.6", linewidth=0.8)
        ax.axhline(0.98, color=OURS_COLOR, linewidth=0.8, linestyle=(0, (2, 2)))
        ax.grid(axis="y", color="0.9")
    # A ratio of step counts; the unit names both (tests/test_plots_readable.py).
    top.set_ylabel("goodput each second\n(steps, useful / fault-free)")
    bottom.set_ylabel("goodput since the start\n(steps, useful / fault-free)")
    bottom.set_xlabel("seconds since the first step at 3 nodes")
    # Every value on the figure: the cumulative panel zooms past its noisy first tenth.
    top.set_ylim(0, max(highs))
    bottom.set_ylim(max(0.0, min(lows)), max(cum_highs))
    handles += [
        Line2D([], [], color=KILL_COLOR, linestyle="--", label="SIGKILL of a node"),
        Line2D([], [], color=JOIN_COLOR, linestyle=":", label="the node rejoins"),
        Line2D([], [], color=OURS_COLOR, linestyle=(0, (2, 2)), label="goal 0.98"),
    ]
    fig.legend(handles=handles, loc="lower center", fontsize=8, ncol=len(handles), frameon=False)
    fig.suptitle(title, fontsize=12, fontweight="bold")
    fig.text(0.5, 0.935, f"goodput over the whole window: {', '.join(totals)} "
             f"(denominator: {settings['denominator']})", ha="center", fontsize=7.5,
             color="0.35")  # fmt: skip
    fig.subplots_adjust(top=0.86, bottom=0.14, left=0.08, right=0.98)
    return fig
