"""PNG plots of the results (matplotlib, the ``bench`` extra), made to read at a glance.

In every plot "ours" has one strong colour (:data:`OURS_COLOR`), a heavier line
or edge and a bold tick label, and comes first in the legend (our variants share
its hue, hatched); a value axis spanning a decade or more is logarithmic; every
quantity axis names its unit; competitors differ in marker, line style and
fill, nudged apart on a log x axis, so none hides another; and a competitor
with no result at a point gets an ``X`` in a grey "no result" band with a
legend entry naming why (a value from only some runs says how many failed).
Figures are built without pyplot's global state, so tests can inspect them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

OURS_COLOR = "#D55E00"  # Okabe-Ito vermilion; the palette below reads for colour-blind eyes
OTHER_COLORS = ("#0072B2", "#009E73", "#CC79A7", "#56B4E9", "#E69F00", "#000000")
BASELINE_COLOR = "#BBBBBB"
FAIL_COLOR = "#B00000"
OTHER_MARKERS = ("s", "^", "D", "v", "P", "*")
OTHER_LINESTYLES = ("--", ":", "-.", (0, (5, 1)), (0, (1, 2)), (0, (3, 1, 1, 1)))
#: The axis fraction above which only failure markers go.
BAND = 0.82
DPI = 110


# -- who is who ---------------------------------------------------------------


def role(benchmark: str, name: str) -> str:
    """``ours``, ``ours-variant``, ``baseline`` (no checkpointing at all) or ``other``."""
    if name == "ours":
        return "ours"
    if name.startswith("ours-"):
        return "ours-variant"
    if benchmark == "checkpoint_cost":
        if name.endswith(("-async", "-snapshot")):
            return "ours"
        return "baseline" if name.endswith("-none") else "other"
    return "other"


def ordered(benchmark: str, names: list[str]) -> list[str]:
    """Ours first, then our variants, then the rest in their own order.

    ``checkpoint_cost`` keeps each model size together (``large-*``, ``small-*``)
    and orders within it.
    """
    rank = {"ours": 0, "ours-variant": 1, "other": 2, "baseline": 3}
    groups = list(dict.fromkeys(_group(benchmark, n) for n in names))
    return sorted(
        names, key=lambda n: (groups.index(_group(benchmark, n)), rank[role(benchmark, n)])
    )


def _group(benchmark: str, name: str) -> str:
    return name.split("-", 1)[0] if benchmark == "checkpoint_cost" else ""


#: (substring of an error, what the plots call it); the first match wins.
_REASONS = (
    ("timed out", "timed out"),
    ("timeout", "timed out"),
    ("every agent exited", "agents exited"),
    ("bad round", "inconsistent round"),
)


def failure_reason(errors: list[str]) -> str:
    """The most common kind of error, in two or three words."""
    kinds = [
        next((why for text, why in _REASONS if text in e.lower()), e.split(":", 1)[0][:30])
        for e in errors
    ]
    return Counter(kinds).most_common(1)[0][0] if kinds else "no result"


def _bar_style(benchmark: str, name: str) -> dict[str, Any]:
    kind = role(benchmark, name)
    if kind == "ours":
        return {"facecolor": OURS_COLOR, "edgecolor": "black", "linewidth": 1.6, "zorder": 3}
    if kind == "ours-variant":
        return {"facecolor": OURS_COLOR, "alpha": 0.45, "hatch": "//", "edgecolor": OURS_COLOR}
    if kind == "baseline":
        return {"facecolor": BASELINE_COLOR, "hatch": "..", "edgecolor": "0.4"}
    # One colour for every competitor: the tick labels name them, and the eye
    # only has to find ours against the rest.
    return {"facecolor": OTHER_COLORS[0], "alpha": 0.75}


# -- axes ---------------------------------------------------------------------


def _spans_decades(values: list[float]) -> bool:
    """Whether the positive values span a factor of 10 or more."""
    positive = [v for v in values if v and v > 0]
    return bool(positive) and max(positive) >= 10 * min(positive)


def _fit(ax: Axes, values: list[float], *, log: bool, band: bool, top: float = 0.88) -> None:
    """Y limits that keep the data below ``top`` of the axis, below the failure band if any."""
    top_fraction = min(top, BAND - 0.08) if band else top
    if log:
        ax.set_yscale("log")
        positive = [v for v in values if v > 0]
        if not positive:
            return
        low, high = min(positive) / 1.6, max(positive)
        ax.set_ylim(low, low * (high / low) ** (1 / top_fraction))
    else:
        high = max([v for v in values if v is not None] or [1.0]) or 1.0
        ax.set_ylim(0, high / top_fraction)


def _plain_log_ticks(ax: Axes) -> None:
    """1, 2, 5, 10 ... on a log axis rather than 10^0, 10^1: read, not decoded."""
    if ax.get_yscale() == "log":
        low, high = ax.get_ylim()
        subs = (1.0,) if high / low > 10**3.3 else (1.0, 2.0, 5.0)
        ax.yaxis.set_major_locator(LogLocator(subs=subs))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())


def _failure_band(ax: Axes) -> None:
    """Grey out the top of the axis for failure markers, with no value ticks in it.

    Call it once the scale, limits and tick locator are final.
    """
    to_axes = ax.transData + ax.transAxes.inverted()
    low = ax.get_ylim()[0]
    ticks = [t for t in ax.get_yticks() if low <= t and to_axes.transform((0, t))[1] < BAND]
    ax.set_yticks(ticks)
    ax.add_patch(Rectangle((0, BAND), 1, 1 - BAND, transform=ax.transAxes, color="0.93", zorder=0))
    ax.text(0.01, 0.985, "no result", transform=ax.transAxes, fontsize=7, color="0.45",
            va="top")  # fmt: skip


def _failure_marker(ax: Axes, x: float, slot: int, *, color: str, gid: str) -> None:
    """An ``X`` at ``x`` (data) in the band; ``slot`` stacks several at one x."""
    y = BAND + (1 - BAND) * (0.35 + 0.3 * (slot % 2))
    ax.plot([x], [y], transform=ax.get_xaxis_transform(), marker="X", markersize=11,
            color=color, markeredgecolor="black", linestyle="none", zorder=5, gid=gid,
            clip_on=False)  # fmt: skip


def _finish(fig: Figure, title: str, subtitle: str) -> Figure:
    fig.suptitle(title, fontsize=12, fontweight="bold")
    fig.text(0.5, 0.915, subtitle, ha="center", fontsize=8, color="0.35")
    return fig


# -- bar charts ---------------------------------------------------------------


def _bars(
    ax: Axes,
    benchmark: str,
    summary: dict[str, Any],
    metric: str,
    *,
    unit: str = "",
    log: bool | None = None,
    top: float = 0.88,
    missing: str = "no value",
    integer: bool = False,
) -> None:
    """Median bars, min-max whiskers, failures marked; ``log=None``: log if values span 10x.

    ``top``: the axis fraction the data may reach; ``missing``: the note under a
    bar with neither a value nor an error (nothing to measure); ``integer``:
    whole-number ticks, for counts such as lost steps.
    """
    names = ordered(benchmark, list(summary))
    stats = [summary[n][metric] for n in names]
    values = [v for s in stats for v in (s["median"], s.get("min"), s.get("max")) if v is not None]
    no_result = any(_no_result(summary[n], metric) for n in names)
    partial = any(summary[n]["errors"] and summary[n][metric]["median"] is not None for n in names)
    scale = _spans_decades(values) if log is None else log
    _fit(ax, values, log=scale, band=no_result, top=min(top, 0.66) if partial else top)
    for i, (name, stat) in enumerate(zip(names, stats, strict=True)):
        if stat["median"] is not None:
            _bar(ax, i, stat, unit=unit, style=_bar_style(benchmark, name))
    ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
    # Every slot a full bar wide, a bar drawn or not, so no label runs off the axes.
    ax.set_xlim(-0.6, len(names) - 0.4)
    if integer:
        # All zeros (no competitor result) would leave 0 and 1 as the only ticks.
        ax.set_ylim(top=max(ax.get_ylim()[1], 2.5))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for label in ax.get_xticklabels():
        if role(benchmark, label.get_text()) == "ours":
            label.set(fontweight="bold", color=OURS_COLOR)
    _plain_log_ticks(ax)
    if no_result:
        _failure_band(ax)
    for i, name in enumerate(names):
        _bar_failure(ax, i, summary[name], metric, missing=missing)
    ax.grid(axis="y", which="major", alpha=0.3)


def _no_result(entry: dict[str, Any], metric: str) -> bool:
    """Nothing to draw because the runs failed (or the competitor could not run)."""
    missing = entry[metric]["median"] is None
    return bool(entry.get("unavailable")) or (bool(entry["errors"]) and missing)


def _bar(ax: Axes, x: int, stat: dict[str, Any], *, unit: str, style: dict[str, Any]) -> None:
    """One median bar, its min-max whisker, and its value written above the whisker."""
    median = stat["median"]
    low = median if stat.get("min") is None else stat["min"]
    high = median if stat.get("max") is None else stat["max"]
    ax.bar([x], [median], yerr=[[median - low], [high - median]], capsize=4,
           error_kw={"elinewidth": 1, "ecolor": "0.25"}, **style)  # fmt: skip
    text = f"{median:.3g}" if abs(median) < 1000 else f"{median:,.0f}"
    ax.annotate(f"{text} {unit}".strip(), (x, high), xytext=(0, 3), textcoords="offset points",
                ha="center", va="bottom", fontsize=8, gid=f"value:{x}")  # fmt: skip


def _bar_failure(ax: Axes, x: int, entry: dict[str, Any], metric: str, *, missing: str) -> None:
    errors, ok = entry["errors"], entry[metric]["n"]
    if _no_result(entry, metric):
        why = "not run" if entry.get("unavailable") else f"all {len(errors)} failed:\n"
        _failure_marker(ax, x, 0, color=FAIL_COLOR, gid=f"failure:{x}")
        ax.annotate(why + (failure_reason(errors) if errors else ""), (x, BAND),
                    xycoords=("data", "axes fraction"), ha="center", va="top", fontsize=7,
                    color=FAIL_COLOR, xytext=(0, -3), textcoords="offset points")  # fmt: skip
    elif errors:
        stat = entry[metric]
        high = stat["median"] if stat.get("max") is None else stat["max"]
        ax.annotate(f"{len(errors)}/{len(errors) + ok} runs failed", (x, high),
                    xytext=(0, 14), textcoords="offset points", ha="center", va="bottom",
                    fontsize=7, color=FAIL_COLOR, gid=f"partial-failure:{x}")  # fmt: skip
    elif entry[metric]["median"] is None:
        ax.annotate(missing, (x, 0.02), xycoords=("data", "axes fraction"), ha="center",
                    fontsize=7, color="0.45")  # fmt: skip


def _bar_legend(
    fig: Figure,
    benchmark: str,
    summary: dict[str, Any],
    metrics: tuple[str, ...],
    *,
    others: str = "competitors",
) -> None:
    """Ours first; a failure entry only where a drawn metric has no result."""
    handles: list[Any] = []
    kinds = (("ours", "ours"), ("ours-variant", "our variants"), ("other", others),
             ("baseline", "no checkpoint"))  # fmt: skip
    for kind, label in kinds:
        first = next((n for n in summary if role(benchmark, n) == kind), None)
        if first is not None:
            handles.append(Patch(**_bar_style(benchmark, first), label=label))
    if any(_no_result(e, m) for e in summary.values() for m in metrics):
        handles.append(Line2D([], [], marker="X", color=FAIL_COLOR, markeredgecolor="black",
                              linestyle="none", markersize=9,
                              label="all runs failed (reason below)"))  # fmt: skip
    handles.append(Line2D([], [], color="0.25", marker="_", markersize=10, label="min-max"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)


def _bar_figure(kind: str, result: dict[str, Any], title: str) -> Figure:
    """The bar figure :data:`BAR_FIGURES` describes under ``kind``."""
    panels, subtitle, others = BAR_FIGURES[kind]
    benchmark, summary = result["benchmark"], result["summary"]
    fig = Figure(figsize=(4 + 4 * len(panels), 4.8))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (metric, label, options) in zip(axes, panels, strict=True):
        _bars(ax, benchmark, summary, metric, **options)
        ax.set_ylabel(label)
        if benchmark == "checkpoint_cost":
            _size_groups(ax, ordered(benchmark, list(summary)), summary)
    _bar_legend(fig, benchmark, summary, tuple(p[0] for p in panels), others=others)
    fig.subplots_adjust(left=0.12 if len(panels) == 1 else 0.08, right=0.98, top=0.86,
                        bottom=0.3, wspace=0.25)  # fmt: skip
    return _finish(fig, title, f"median of {result['repeats']} runs; {subtitle}")


#: Each bar figure: its panels ``(metric, y label, _bars options)``, subtitle, and
#: what the legend calls the others.
BAR_FIGURES: dict[str, tuple[list[tuple[str, str, dict[str, Any]]], str, str]] = {
    "event": (
        [("seconds", "event -> first step after it (s)", {"unit": "s"}),
         ("lost_steps", "lost steps (steps)", {"log": False, "integer": True})],  # often 0
        "bars: median, whiskers: min-max; lower is better", "competitors"),
    "throughput": (
        [("samples_per_second", "throughput (samples/s)", {"log": False})],
        "interleaved; whiskers: min-max; higher is better", "competitors"),
    "checkpoint_cost": (
        [("samples_per_second", "training throughput (samples/s, log)", {"log": True, "top": 0.8}),
         ("blocked_seconds_per_save", "training blocked per save (s, log)",
          {"log": True, "top": 0.8, "unit": "s", "missing": "no saves"})],
        "the large model and the small MLP differ 300x, hence the log scales",
        "other ways to save"),
}  # fmt: skip


def _size_groups(ax: Axes, names: list[str], summary: dict[str, Any]) -> None:
    """Label each model size once above its bars (``large: 202 MB state``), a line between."""
    for prefix in dict.fromkeys(n.split("-", 1)[0] for n in names):
        xs = [i for i, n in enumerate(names) if n.startswith(f"{prefix}-")]
        if xs[0] > 0:
            ax.axvline(xs[0] - 0.5, color="0.5", linestyle="--", linewidth=1)
        mb = summary[names[xs[0]]]["state_mb"]["median"]
        label = f"{prefix}: {mb:.3g} MB state" if mb is not None else prefix
        ax.annotate(label, (sum(xs) / len(xs), 0.98), xycoords=("data", "axes fraction"),
                    ha="center", va="top", fontsize=8, color="0.3", style="italic")  # fmt: skip


# -- rendezvous at scale ----------------------------------------------------------


def _series_style(name: str, index: int) -> dict[str, Any]:
    if name == "ours":
        return {"color": OURS_COLOR, "linewidth": 2.8, "marker": "o", "markersize": 8,
                "linestyle": "-", "zorder": 4}  # fmt: skip
    i = index % len(OTHER_COLORS)
    return {"color": OTHER_COLORS[i], "linewidth": 1.6, "marker": OTHER_MARKERS[i],
            "markersize": 7, "linestyle": OTHER_LINESTYLES[i], "alpha": 0.9, "zorder": 3,
            "markerfacecolor": "none" if i % 2 == 0 else OTHER_COLORS[i]}  # fmt: skip


def _scale_points(
    by_agents: dict[str, Any], name: str, metric: str
) -> tuple[list[tuple[int, float]], list[int], list[tuple[int, float, int, int]]]:
    """(K, median) points, the Ks with no result, and (K, median, failed, runs) partials."""
    points, failed, partial = [], [], []
    for k in sorted(by_agents, key=int):
        entry = by_agents[k]["summary"].get(name)
        if entry is None:
            continue
        median, errors = entry[metric]["median"], entry["errors"]
        if median is None and (errors or entry.get("unavailable")):
            failed.append(int(k))
        elif median is not None:
            points.append((int(k), median))
            if errors:
                partial.append((int(k), median, len(errors), len(errors) + entry[metric]["n"]))
    return points, failed, partial


def _scale_panel(
    ax: Axes, result: dict[str, Any], metric: str, names: list[str]
) -> dict[str, list[int]]:
    """One metric over K, every series visible; returns ``{name: the Ks with no result}``."""
    by_agents, failing = result["by_agents"], {}
    values = []
    for j, name in enumerate(names):
        nudge = 2 ** (0.06 * (j - (len(names) - 1) / 2))  # apart on the log x axis
        points, failed, partial = _scale_points(by_agents, name, metric)
        if metric == "idle_requests_per_agent_per_s" and not points:
            # A TCPStore has no request counter: its backend calls (one store
            # request each) stand in, as the subtitle says.
            points, failed, partial = _scale_points(
                by_agents, name, "backend_calls_per_agent_per_s"
            )
        if points:
            ks, ys = zip(*points, strict=True)
            ax.plot([k * nudge for k in ks], ys, label=name, **_series_style(name, j))
            values += ys
        for k, y, bad, runs in partial:
            ax.plot([k * nudge], [y], marker="o", markersize=16, markerfacecolor="none",
                    markeredgecolor=FAIL_COLOR, linestyle="none", zorder=6,
                    gid=f"partial-failure:{name}:{k}")  # fmt: skip
            ax.annotate(f"{bad}/{runs} runs failed", (k * nudge, y), xytext=(0, 11), ha="center",
                        textcoords="offset points", fontsize=7, color=FAIL_COLOR)  # fmt: skip
        for k in failed:
            color = _series_style(name, j)["color"]
            _failure_marker(ax, k * nudge, j, color=color, gid=f"failure:{name}:{k}")
            failing.setdefault(name, []).append(k)
    _fit(ax, values, log=_spans_decades(values), band=bool(failing))
    if ax.get_yscale() == "linear":
        ax.set_ylim(bottom=-0.03 * ax.get_ylim()[1])  # a series at 0 stays off the spine
    _plain_log_ticks(ax)
    if failing:
        _failure_band(ax)
    ks = sorted(int(k) for k in by_agents)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set_xlim(ks[0] / 1.5, ks[-1] * 1.5)
    ax.set_xlabel("agents K (count, log scale)")
    ax.grid(alpha=0.3)
    return failing


def _scale_legend(
    fig: Figure, result: dict[str, Any], names: list[str], failing: dict[str, list[int]]
) -> None:
    """The series on one row, ours first; the failure markers on the row below."""
    series = [Line2D([], [], label=name, **_series_style(name, j)) for j, name in enumerate(names)]
    fig.legend(handles=series, loc="lower center", ncol=len(names), fontsize=9, frameon=False,
               bbox_to_anchor=(0.5, 0.07))  # fmt: skip
    handles = []
    for name in (n for n in names if n in failing):
        ks = sorted(set(failing[name]))
        errors = [e for k in ks for e in result["by_agents"][str(k)]["summary"][name]["errors"]]
        handles.append(Line2D([], [], marker="X", markersize=10, linestyle="none",
                              color=_series_style(name, names.index(name))["color"],
                              markeredgecolor="black", label=f"{name}: no result at K = "
                              f"{', '.join(map(str, ks))} ({failure_reason(errors)})"))  # fmt: skip
    if any(e["errors"] and e["round_seconds"]["median"] is not None
           for b in result["by_agents"].values() for e in b["summary"].values()):  # fmt: skip
        handles.append(Line2D([], [], marker="o", markersize=11, markerfacecolor="none",
                              markeredgecolor=FAIL_COLOR, linestyle="none",
                              label="some runs failed: median of the rest"))  # fmt: skip
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8,
                   frameon=False, bbox_to_anchor=(0.5, 0.0))  # fmt: skip


def rendezvous_scale(result: dict[str, Any], title: str) -> Figure:
    names = ordered(result["benchmark"], list(next(iter(result["by_agents"].values()))["summary"]))
    fig = Figure(figsize=(14, 5.4))
    axes = fig.subplots(1, 3)
    panels = (
        ("round_seconds", "first rendezvous round (s)"),
        ("rerendezvous_seconds", "re-rendezvous after a node leaves (s)"),
        ("idle_requests_per_agent_per_s", "idle load (requests/s per agent)"),
    )
    failing: dict[str, list[int]] = {}
    for ax, (metric, label) in zip(axes, panels, strict=True):
        for name, ks in _scale_panel(ax, result, metric, names).items():
            failing.setdefault(name, []).extend(ks)
        ax.set_ylabel(label)
    _scale_legend(fig, result, names, failing)
    fig.subplots_adjust(left=0.05, right=0.99, top=0.86, bottom=0.27, wspace=0.25)
    return _finish(fig, title, f"median of {result['repeats']} runs per K; lower is better; "
                   "idle load: etcd requests, or TCPStore calls where no etcd")  # fmt: skip


#: The bar figure of each benchmark; ``rendezvous_scale`` has its own.
BAR_KIND = {"recovery": "event", "scaleup": "event", "preemption": "event",
            "throughput": "throughput", "checkpoint_cost": "checkpoint_cost"}  # fmt: skip


def figure(name: str, result: dict[str, Any], title: str | None = None) -> Figure:
    """The figure of benchmark ``name``; ``title`` defaults to the name."""
    if name == "rendezvous_scale":
        return rendezvous_scale(result, title or name)
    if name == "goodput":
        from benchmarks.plots_goodput import goodput_figure  # it imports this module's styles

        return goodput_figure(result, title or name)
    return _bar_figure(BAR_KIND[name], result, title or name)


def draw_all(
    results: dict[str, dict[str, Any]],
    directory: Path,
    *,
    suffix: str = "",
    titles: dict[str, str] | None = None,
) -> list[Path]:
    """One PNG per benchmark, ``{directory}/{name}{suffix}.png``; returns the paths."""
    paths = []
    for name, result in results.items():
        path = directory / f"{name}{suffix}.png"
        figure(name, result, (titles or {}).get(name)).savefig(path, dpi=DPI)
        paths.append(path)
    return paths
