"""The headline of the repository's README, regenerated from ``benchmarks/results/*.json``.

    python -m benchmarks.readme           # rewrite it between the markers
    python -m benchmarks.readme --check   # exit 1 if the README differs from the results

The table and the embedded recovery plot go between the
``<!-- headline:start -->`` and ``<!-- headline:end -->`` markers of the
top-level README.md; ``python -m benchmarks.report`` rewrites them too.
``tests/test_readme_headline.py`` fails when the README drifts from the
committed results.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS_DIR
from benchmarks.report import TABLES, load

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- headline:start -->", "<!-- headline:end -->"
#: The torchrun the headline compares with: its default rendezvous backend, c10d,
#: tuned (short last call and keep-alive) and at PyTorch's defaults.
TUNED, DEFAULT = "c10d-tuned", "c10d-default"
THROUGHPUT_TARGET = "ours / plain DDP samples/s"
PLOT = "recovery"


def _seconds(stat: dict[str, Any] | None) -> str:
    if not stat or stat.get("median") is None:
        return "no result"
    return f"{stat['median']:.2f} s"


def _steps(stat: dict[str, Any] | None) -> str:
    """Median and worst case: lost work is about its bound as much as its middle."""
    if not stat or stat.get("median") is None:
        return "no result"
    return f"{stat['median']:.0f} (max {stat['max']:.0f})"


def _times(result: dict[str, Any], name: str) -> str:
    ratio = result["ratios"].get(name)
    return f" ({ratio:.1f}x ours)" if ratio and name != "ours" else ""


def _failed(result: dict[str, Any], name: str) -> str:
    """The runs that gave no number: a median of the rest must say so."""
    errors = _entry(result, name).get("errors") or []
    return f"; {len(errors)} of {result['repeats']} runs failed" if errors else ""


def _entry(result: dict[str, Any], name: str) -> dict[str, Any]:
    return result["summary"].get(name) or {}


def _event_rows(results: dict[str, dict[str, Any]]) -> list[str]:
    """Time to the first step after the event, and the steps it cost."""
    rows = []
    events = [("recovery", "Recovery: SIGKILL of 1 of 3 nodes", "that kill"),
              ("preemption", "Preemption: SIGTERM to 1 of 3 nodes", "that SIGTERM")]  # fmt: skip
    for name, title, event in events:
        if (result := results.get(name)) is None:
            continue
        seconds = [_seconds(_entry(result, n).get("seconds")) + _times(result, n)
                   + _failed(result, n) for n in ("ours", TUNED, DEFAULT)]  # fmt: skip
        lost = [_steps(_entry(result, n).get("lost_steps")) for n in ("ours", TUNED, DEFAULT)]
        rows.append(f"| {title} → first step | **{seconds[0]}** | {seconds[1]} | {seconds[2]} |")
        rows.append(f"| Steps lost to {event} | **{lost[0]}** | {lost[1]} | {lost[2]} |")
    return rows


def _join_row(result: dict[str, Any]) -> str:
    """A node joining: its agent's start to the first step at the larger world (it
    has a target), and how long the others' steps stopped for it (one step included)."""
    missed = [t for t in result.get("targets", []) if t["met"] is False]
    above = f" (above the {missed[0]['limit']:g} s target)" if missed else ""

    def cell(name: str) -> str:
        entry = _entry(result, name)
        if (entry.get("seconds") or {}).get("median") is None:
            return _failed(result, name).removeprefix("; ") or "no result"
        note = above if name == "ours" else ""
        stall = _seconds(entry.get("stall_seconds"))
        return f"{_seconds(entry['seconds'])}{note}; stall {stall}{_failed(result, name)}"

    nodes = result["settings"]["nodes"]
    ours, tuned, default = (cell(n) for n in ("ours", TUNED, DEFAULT))
    return (f"| A node joins {nodes}: its agent's start → first step at {nodes + 1}; "
            f"the others' stall | **{ours}** | {tuned} | {default} |")  # fmt: skip


def _throughput_row(result: dict[str, Any]) -> str:
    target = next((t for t in result.get("targets", []) if t["name"] == THROUGHPUT_TARGET), None)
    ratio = "no ratio"
    if target:
        missed = f", below the {target['limit']} target" if target["met"] is False else ""
        ratio = f"{target['value']:.3f}x plain DDP{missed}"
    ours, tuned = (_entry(result, n).get("samples_per_second") for n in ("ours", TUNED))
    cell = [f"{s['median']:,.0f} samples/s" if s and s.get("median") else "no result"
            for s in (ours, tuned)]  # fmt: skip
    return (f"| Throughput, 2 nodes, no faults (ratio: median of paired runs) "
            f"| **{cell[0]}** ({ratio}) | {cell[1]} | not run |")  # fmt: skip


def _goodput_row(result: dict[str, Any]) -> str:
    """The soak's goodput: the headline (every interval at the faster world's rate)
    and, in brackets, each interval at its own world size's rate."""
    settings = result["settings"]

    def cell(name: str) -> str:
        entry = _entry(result, name)
        value = (entry.get("goodput") or {}).get("median")
        weighted = (entry.get("goodput_world_weighted") or {}).get("median")
        if value is None:
            return "no result"
        return f"{value:.3f}" + (f" ({weighted:.3f} world-weighted)" if weighted else "")

    return (f"| Goodput: a kill or a rejoin every {settings['every_seconds']:g} s "
            f"for {settings['minutes']:g} min, 3 nodes "
            f"| **{cell('ours')}** | {cell(TUNED)} | not run |")  # fmt: skip


def _scale_row(result: dict[str, Any]) -> str:
    ks = list(result["by_agents"])

    def series(name: str) -> str:
        values = []
        for k in ks:
            stat = result["by_agents"][k]["summary"].get(name, {}).get("round_seconds")
            values.append(f"{stat['median']:.2f}" if stat and stat["median"] is not None else "—")
        return " / ".join(values) + " s"

    timeout = result["settings"].get("join_timeout")
    return (f"| First rendezvous round at K = {' / '.join(ks)} agents "
            f"(—: no round within {timeout} s) "
            f"| **{series('ours')}** | {series(TUNED)} | not run |")  # fmt: skip


def _source_line(results: dict[str, dict[str, Any]]) -> str:
    machines = sorted({(r["machine"]["cpu_model"], r["machine"]["cpu_count"], r["machine"]["torch"])
                       for r in results.values()})  # fmt: skip
    where = "; ".join(f"{cpu}, {cores} cores, torch {torch}" for cpu, cores, torch in machines)
    repeats = sorted({r["repeats"] for r in results.values()})
    runs = f"{repeats[0]}" if len(repeats) == 1 else f"{repeats[0]}-{repeats[-1]}"
    return (f"Medians of {runs} runs per benchmark on {where}, CPU and gloo, one process "
            "per node; regenerated from `benchmarks/results/*.json` by "
            "`python -m benchmarks.readme`. Ranges, method and conditions: "
            "[benchmarks/README.md](benchmarks/README.md).")  # fmt: skip


def _mode_note(results: dict[str, dict[str, Any]]) -> str:
    """Which recovery ours ran: the survivors keeping their processes or restarting."""
    mode = results.get("recovery", {}).get("settings", {}).get("recovery", "restart")
    if mode == "restart":
        return ' Ours ran the restart path (`elastic.recovery = "restart"`).'
    return (" Ours ran at its default, `elastic.recovery = \"auto\"`: in process, the "
            "survivors keep their processes (docs/recovery-inprocess.md).")  # fmt: skip


def headline(results: dict[str, dict[str, Any]]) -> str:
    """The README's headline block: the table, where the numbers come from, the plot."""
    rows = [
        "| measured | elastic_train | torchrun `c10d`, tuned | torchrun `c10d`, defaults |",
        "|---|---|---|---|",
        *_event_rows(results),
    ]
    if "scaleup" in results:
        rows.append(_join_row(results["scaleup"]))
    if "throughput" in results:
        rows.append(_throughput_row(results["throughput"]))
    if "goodput" in results:
        rows.append(_goodput_row(results["goodput"]))
    if "rendezvous_scale" in results:
        rows.append(_scale_row(results["rendezvous_scale"]))
    lines = [*rows, "", _source_line(results) + _mode_note(results), ""]
    if PLOT in results:
        lines.append(f"![{TABLES[PLOT][0]}](benchmarks/results/{PLOT}.png)")
    return "\n".join(lines)


def replace_block(body: str, text: str, *, path: Path) -> str:
    """``body`` with ``text`` between the markers."""
    if START not in body or END not in body:
        raise SystemExit(f"{path} lacks the {START} / {END} markers")
    head, rest = body.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{text}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--readme", type=Path, default=README)
    p.add_argument("--check", action="store_true", help="exit 1 if the README differs")
    args = p.parse_args(argv)
    results = load(args.results_dir, smoke=False)
    if not results:
        raise SystemExit(f"no results in {args.results_dir}; run python -m benchmarks.<name>")
    body = args.readme.read_text()
    updated = replace_block(body, headline(results), path=args.readme)
    if args.check:
        if updated != body:
            sys.stderr.write(f"{args.readme} is stale: run python -m benchmarks.readme\n")
            return 1
        return 0
    args.readme.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
