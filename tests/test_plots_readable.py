"""The benchmark plots read at a glance, checked on the committed ``benchmarks/results/*.json``.

Each figure is built the way ``python -m benchmarks.report`` builds its PNG and
inspected: logarithmic axes where the values span decades, "ours" styled
apart and first in the legend, every failure the JSON records marked (and no
marker where it records none), and a unit on every quantity axis.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from matplotlib.axes import Axes
from matplotlib.colors import to_hex
from matplotlib.container import BarContainer
from matplotlib.figure import Figure

from benchmarks import plots, report

RESULTS = Path(report.__file__).resolve().parent / "results"
COMMITTED = {name: RESULTS / f"{name}.json" for name in report.ALL}
UNITS = {"s", "steps", "samples/s", "requests/s per agent", "count"}


def _result(name: str) -> dict[str, Any]:
    path = COMMITTED[name]
    if not path.exists():
        pytest.skip(f"{path} is not committed")
    return json.loads(path.read_text())


def _figure(name: str) -> Figure:
    return plots.figure(name, _result(name), report.TABLES[name][0])


def _legend_texts(fig: Figure) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def _gids(fig: Figure) -> set[str]:
    return {a.get_gid() for a in fig.findobj(lambda a: a.get_gid() is not None)}


def _bars_by_name(ax: Axes) -> dict[str, Any]:
    """The bar patch of each competitor, found by its tick label."""
    labels = [t.get_text() for t in ax.get_xticklabels()]
    bars = {}
    for container in ax.containers:
        if isinstance(container, BarContainer):
            for patch in container.patches:
                bars[labels[round(patch.get_x() + patch.get_width() / 2)]] = patch
    return bars


def test_the_report_writes_one_png_per_committed_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path in RESULTS.glob("*.json"):
        shutil.copy(path, tmp_path)
    report.main([f"--results-dir={tmp_path}", "--no-readme"])
    capsys.readouterr()
    for name, path in COMMITTED.items():
        if path.exists():
            png = (tmp_path / f"{name}.png").read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, name


@pytest.mark.parametrize(
    ("name", "log_panels"),
    [("checkpoint_cost", [0, 1]), ("rendezvous_scale", [0, 1]), ("recovery", [0])],
)
def test_axes_whose_values_span_decades_are_logarithmic(name: str, log_panels: list[int]) -> None:
    axes = _figure(name).axes
    for i in log_panels:
        assert axes[i].get_yscale() == "log", f"{name} panel {i}: {axes[i].get_ylabel()}"
        low, high = axes[i].get_ylim()
        assert high / low >= 10
    if name == "rendezvous_scale":
        assert all(ax.get_xscale() == "log" for ax in axes)  # K = 2 ... 128


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_ours_is_highlighted_and_first_in_the_legend(name: str) -> None:
    fig, result = _figure(name), _result(name)
    assert _legend_texts(fig)[0] == "ours"
    ours_color = to_hex(plots.OURS_COLOR)
    if name == "rendezvous_scale":
        # Unlabelled lines (``_childN``) belong to a labelled one, e.g. ours'
        # dashed lead to a K where it failed; they share its colour.
        lines = {
            line.get_label(): line
            for line in fig.axes[0].get_lines()
            if not line.get_label().startswith("_")
        }
        ours = lines.pop("ours")
        assert to_hex(ours.get_color()) == ours_color
        assert all(ours.get_linewidth() > line.get_linewidth() for line in lines.values())
        assert all(to_hex(line.get_color()) != ours_color for line in lines.values())
        return
    bars = _bars_by_name(fig.axes[0])
    for competitor, patch in bars.items():
        is_ours = plots.role(result["benchmark"], competitor) == "ours"
        solid_ours = to_hex(patch.get_facecolor()) == ours_color and patch.get_alpha() is None
        assert solid_ours == is_ours, competitor
    bold = {t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_fontweight() == "bold"}
    assert bold == {n for n in bars if plots.role(result["benchmark"], n) == "ours"}


def _expected_scale_failures(result: dict[str, Any]) -> tuple[set[str], set[str]]:
    """The ``failure:NAME:K`` and ``partial-failure:NAME:K`` marks the JSON calls for."""
    failed, partial = set(), set()
    for k, block in result["by_agents"].items():
        for name, entry in block["summary"].items():
            no_result = entry["round_seconds"]["median"] is None
            if no_result and (entry["errors"] or entry.get("unavailable")):
                failed.add(f"failure:{name}:{k}")
            elif entry["errors"]:
                partial.add(f"partial-failure:{name}:{k}")
    return failed, partial


def test_rendezvous_scale_marks_each_failure_the_json_records() -> None:
    result = _result("rendezvous_scale")
    fig = _figure("rendezvous_scale")
    failed, partial = _expected_scale_failures(result)
    for ax in fig.axes:
        gids = {a.get_gid() for a in ax.findobj(lambda a: a.get_gid() is not None)}
        assert {g for g in gids if g.startswith("failure:")} == failed, ax.get_ylabel()
        assert {g for g in gids if g.startswith("partial-failure:")} == partial
    legend = _legend_texts(fig)
    for name in {gid.split(":")[1] for gid in failed}:
        ks = sorted(int(g.split(":")[2]) for g in failed if g.split(":")[1] == name)
        entry = f"{name}: no result at K = {', '.join(map(str, ks))} ("  # then the reason
        assert any(text.startswith(entry) for text in legend), (entry, legend)
    assert any(t.startswith("some runs failed") for t in legend) == bool(partial)


@pytest.mark.parametrize("name", ["recovery", "scaleup", "preemption", "throughput"])
def test_bar_plots_mark_each_failure_the_json_records(name: str) -> None:
    result, fig = _result(name), _figure(name)
    metric = "samples_per_second" if name == "throughput" else "seconds"
    order = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    failed = {
        f"failure:{i}"
        for i, n in enumerate(order)
        if result["summary"][n]["errors"] and result["summary"][n][metric]["median"] is None
    }
    partial = {f"partial-failure:{i}" for i, n in enumerate(order)
               if result["summary"][n]["errors"] and f"failure:{i}" not in failed}  # fmt: skip
    gids = {a.get_gid() for a in fig.axes[0].findobj(lambda a: a.get_gid() is not None)}
    assert {g for g in gids if g.startswith("failure:")} == failed
    assert {g for g in gids if g.startswith("partial-failure:")} == partial
    assert any("failed" in t for t in _legend_texts(fig)) == bool(failed)


def test_a_competitor_that_timed_out_everywhere_gets_a_marker_and_a_legend_entry() -> None:
    """A synthetic result, so the property does not depend on what the last run saw."""
    ok = {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}
    none = {"median": None, "min": None, "max": None, "n": 0}

    def entry(stat: dict[str, Any], errors: list[str]) -> dict[str, Any]:
        metrics = ("round_seconds", "rerendezvous_seconds", "idle_requests_per_agent_per_s",
                   "backend_calls_per_agent_per_s")  # fmt: skip
        return {"unavailable": None, "errors": errors, **{m: stat for m in metrics}}

    timeout = ["RuntimeError: RendezvousTimeoutError for 4 agents"]
    result = {"benchmark": "rendezvous_scale", "repeats": 1, "by_agents": {
        "2": {"summary": {"ours": entry(ok, []), "rival": entry(ok, [])}},
        "4": {"summary": {"ours": entry(ok, []), "rival": entry(none, timeout)}},
    }}  # fmt: skip
    fig = plots.figure("rendezvous_scale", result)
    assert "failure:rival:4" in _gids(fig)
    assert "rival: no result at K = 4 (timed out)" in _legend_texts(fig)


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_every_quantity_axis_names_its_unit(name: str) -> None:
    fig = _figure(name)
    for ax in fig.axes:
        labels = [ax.get_ylabel()] + ([ax.get_xlabel()] if name == "rendezvous_scale" else [])
        for label in labels:
            found = re.search(r"\(([^()]*)\)$", label)
            assert found, f"{name}: {label!r} names no unit"
            assert found.group(1).split(",")[0] in UNITS, f"{name}: {label!r}"


@pytest.mark.parametrize("name", ["recovery", "scaleup", "preemption"])
def test_lost_steps_axes_tick_whole_steps(name: str) -> None:
    ax = _figure(name).axes[1]
    assert ax.get_ylabel() == "lost steps (steps)"
    low, high = ax.get_ylim()
    ticks = [t for t in ax.get_yticks() if low <= t <= high]
    assert len(ticks) >= 3 and all(float(t).is_integer() for t in ticks), ticks


@pytest.mark.parametrize("name", ["recovery", "scaleup", "preemption", "throughput",
                                  "checkpoint_cost"])  # fmt: skip
def test_every_bar_slot_lies_inside_its_axes(name: str) -> None:
    """A slot without a bar (no saves, no result) still gets its full width, so the
    group labels and notes above it are not cut off at the frame."""
    for ax in _figure(name).axes:
        slots = len(ax.get_xticklabels())
        left, right = ax.get_xlim()
        assert left <= -0.5 and right >= slots - 0.5, (ax.get_ylabel(), left, right, slots)
