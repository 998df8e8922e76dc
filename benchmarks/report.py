"""Turn ``benchmarks/results/*.json`` into the README's tables and PNG plots.

    python -m benchmarks.report            # rewrites benchmarks/README.md and README.md's headline
    python -m benchmarks.report --smoke    # the *_smoke.json files, printed only

Tables go between the ``<!-- results:start -->`` and ``<!-- results:end -->``
markers of the README; plots go next to the JSON files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS_DIR, summarize

README = Path(__file__).resolve().parent / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
EVENT_BENCHMARKS = ("recovery", "scaleup", "preemption")
ALL = (*EVENT_BENCHMARKS, "throughput", "checkpoint_cost", "rendezvous_scale", "goodput")
#: Per fault kind, one run of each (``--out-dir`` of the event benchmarks): the
#: kind's name in the table and the result file.
FAULT_KINDS_DIR = "goodput_faults"
FAULT_KINDS = (
    ("SIGKILL of a node not running rank 0", "recovery_nonzero"),
    ("SIGKILL of the node running rank 0", "recovery_rank0"),
    ("SIGTERM preemption of a node", "preemption"),
    ("a 4th node joins 3 (survivors' stall)", "scaleup"),
    ("SIGKILL of a node before its first group", "startup_fault"),
)
#: the issue's comparison: ours against tuned torchrun c10d
FAULT_KIND_COMPETITORS = ("ours", "c10d-tuned")


def load(directory: Path, *, smoke: bool) -> dict[str, dict[str, Any]]:
    suffix = "_smoke" if smoke else ""
    found = {}
    for name in ALL:
        path = directory / f"{name}{suffix}.json"
        if path.exists():
            found[name] = json.loads(path.read_text())
    return found


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def spread(stat: dict[str, Any] | None, digits: int = 2) -> str:
    """``median (min-max)`` of a summarized metric."""
    if not stat or stat.get("median") is None:
        return "n/a"
    if stat.get("min") is None or stat["n"] <= 1:
        return fmt(stat["median"], digits)
    return f"{fmt(stat['median'], digits)} ({fmt(stat['min'], digits)}-{fmt(stat['max'], digits)})"


def status(entry: dict[str, Any]) -> str:
    if entry.get("unavailable"):
        return f"not run: {entry['unavailable']}"
    errors = entry.get("errors") or []
    return f"{len(errors)} failed: {errors[0][:120]}" if errors else ""


def machine_line(result: dict[str, Any]) -> str:
    m = result["machine"]
    when = datetime.datetime.fromtimestamp(result["started"], tz=datetime.timezone.utc)
    return (
        f"_{m['cpu_model']}, {m['cpu_count']} cores, load {fmt(m['loadavg_1m_at_start'], 1)} "
        f"at start; torch {m['torch']}; commit {m['git_commit']}; "
        f"{when:%Y-%m-%d %H:%M} UTC; {result['repeats']} repeats_"
    )


def event_table(result: dict[str, Any]) -> list[str]:
    rows = [
        "| competitor | event -> first step, s | median ÷ ours' | lost steps | noticed, s "
        "| round closed, s | restored, s | runs | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in result["summary"].items():
        rows.append(
            f"| {name} | {spread(entry['seconds'])} | {fmt(result['ratios'].get(name))} "
            f"| {spread(entry['lost_steps'], 0)} "
            f"| {fmt(entry['failure_noticed_seconds']['median'])} "
            f"| {fmt(entry['round_closed_seconds']['median'])} "
            f"| {fmt(entry['restored_seconds']['median'])} | {entry['seconds']['n']} "
            f"| {status(entry)} |"
        )
    return rows


def throughput_table(result: dict[str, Any]) -> list[str]:
    rows = [
        "| competitor | samples/s | median ÷ ours' | ÷ ours' in the same repetition "
        "| runs | notes |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in result["summary"].items():
        rows.append(
            f"| {name} | {spread(entry['samples_per_second'], 0)} "
            f"| {fmt(result['ratios'].get(name), 3)} | {spread(entry.get('paired_ratio'), 3)} "
            f"| {entry['samples_per_second']['n']} "
            f"| {status(entry)} |"
        )
    return rows


def checkpoint_table(result: dict[str, Any]) -> list[str]:
    rows = [
        "| variant | state, MB | samples/s | throughput loss | loss within runs "
        "| blocked per save, s | first save blocked, s | later saves blocked, s "
        "| save time, s | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in result["summary"].items():
        rows.append(
            f"| {name} | {fmt(entry['state_mb']['median'], 0)} "
            f"| {spread(entry['samples_per_second'], 0)} "
            f"| {fmt(entry.get('throughput_loss', {}).get('median'), 3)} "
            f"| {spread(entry.get('in_run_loss'), 3)} "
            f"| {spread(entry['blocked_seconds_per_save'], 3)} "
            f"| {spread(entry.get('first_save_blocked_seconds'), 3)} "
            f"| {spread(entry.get('later_saves_blocked_seconds'), 3)} "
            f"| {spread(entry['save_seconds_per_save'], 3)} | {status(entry)} |"
        )
    return rows


def scale_table(result: dict[str, Any]) -> list[str]:
    rows = [
        "| K | backend | round, s | re-rendezvous, s | idle etcd req/s/agent "
        "| backend calls/s/agent | CAS conflicts (round / re-round) | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, block in result["by_agents"].items():
        for name, e in block["summary"].items():
            rows.append(
                f"| {k} | {name} | {spread(e['round_seconds'])} "
                f"| {spread(e['rerendezvous_seconds'])} "
                f"| {spread(e['idle_requests_per_agent_per_s'])} "
                f"| {spread(e['backend_calls_per_agent_per_s'])} "
                f"| {fmt(e['round_cas_conflicts']['median'], 0)} / "
                f"{fmt(e['rerendezvous_cas_conflicts']['median'], 0)} | {status(e)} |"
            )
    return rows


def targets_table(results: dict[str, dict[str, Any]]) -> list[str]:
    rows = ["| benchmark | target | measured | limit | met |", "|---|---|---|---|---|"]
    for name, result in results.items():
        for t in result.get("targets", []):
            met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
            bound = "<=" if t["kind"] == "max" else ">="
            rows.append(
                f"| {name} | {t['name']} | {fmt(t['value'], 3)} | {bound} {t['limit']} | {met} |"
            )
    return rows


def goodput_table(result: dict[str, Any]) -> list[str]:
    settings = result["settings"]
    rows = [
        "| competitor | goodput (quiet segments) | world-weighted | vs separate fault-free runs "
        "| vs the 3-node run | useful steps/s | fault-free steps/s: quiet / separate "
        "| kills of a training node | to first step after one, s | after a rejoin, s "
        "| most lost steps per kill | runs | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in result["summary"].items():
        if "-fault-free" in name:
            continue
        rows.append(
            f"| {name} | {spread(e['goodput'], 3)} "
            f"| {spread(e.get('goodput_world_weighted'), 3)} "
            f"| {spread(e['goodput_separate_run'], 3)} "
            f"| {spread(e['goodput_full_world'], 3)} "
            f"| {spread(e['useful_steps_per_second'], 0)} "
            f"| {fmt(e['fault_free_steps_per_second']['median'], 0)} / "
            f"{fmt(e['separate_run_steps_per_second']['median'], 0)} "
            f"| {fmt(e['kills']['median'], 0)} | {spread(e['kill_seconds'])} "
            f"| {spread(e['join_seconds'])} | {fmt(e['kill_max_lost_steps']['max'], 0)} "
            f"| {e['goodput']['n']} | {status(e)} |"
        )
    head = (f"_one event every {settings['every_seconds']:g} s for {settings['minutes']:g} min, "
            f"fault-free runs of {settings['fault_free_minutes']:g} min; "
            f"ours' recovery: {settings['recovery_run']}_")  # fmt: skip
    return [head, "", *rows]


def fault_kinds_table(directory: Path) -> list[str]:
    """p50/p95 of each fault kind's recovery, from the runs (older summaries lack p95),
    with the machine line of each result: they may come from different runs."""
    rows = [
        "| fault | competitor | event -> first step p50 / p95, s | survivors' stall "
        "p50 / p95, s | lost steps median (max) | runs | taken (UTC), load | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, name in FAULT_KINDS:
        # A kind not rerun for this table: the benchmark's own latest result.
        path = next((d / f"{name}.json" for d in (directory, directory.parent)
                     if (d / f"{name}.json").exists()), None)  # fmt: skip
        if path is None:
            continue
        result = json.loads(path.read_text())
        when = datetime.datetime.fromtimestamp(result["started"], tz=datetime.timezone.utc)
        taken = f"{when:%m-%d %H:%M}, {fmt(result['machine']['loadavg_1m_at_start'], 0)}"
        for comp, outcome in result["runs"].items():
            if comp not in FAULT_KIND_COMPETITORS:
                continue
            runs = [r for r in outcome["runs"] if "error" not in r]
            secs = summarize([r.get("seconds") for r in runs])
            stall = summarize([r.get("stall_seconds") for r in runs])
            lost = summarize([r.get("lost_steps") for r in runs])
            rows.append(
                f"| {kind} | {comp} | {fmt(secs['median'])} / {fmt(secs['p95'])} "
                f"| {fmt(stall['median'])} / {fmt(stall['p95'])} "
                f"| {fmt(lost['median'], 0)} ({fmt(lost['max'], 0)}) | {secs['n']} "
                f"| {taken} | {status(result['summary'][comp])} |"
            )
    return rows


TABLES = {
    "recovery": ("Recovery after SIGKILL of 1 of 3 nodes", event_table),
    "scaleup": ("Scale-up: a 4th node joins 3", event_table),
    "preemption": ("Graceful preemption: SIGTERM to 1 of 3 nodes", event_table),
    "throughput": ("Steady-state throughput, 2 nodes", throughput_table),
    "checkpoint_cost": ("Checkpoint cost", checkpoint_table),
    "rendezvous_scale": ("Rendezvous latency and etcd load at scale", scale_table),
    "goodput": ("Goodput soak: a kill or a rejoin every 30 s, 3 nodes", goodput_table),
}


def markdown(results: dict[str, dict[str, Any]], kinds: Path | None = None) -> str:
    lines = ["### Targets", "", *targets_table(results), ""]
    for name, result in results.items():
        title, table = TABLES[name]
        lines += [f"### {title}", "", machine_line(result), "", *table(result), ""]
        plot = f"{name}.png"
        lines += [f"![{title}](results/{plot})", ""]
    if kinds is not None and kinds.is_dir():
        lines += ["### Recovery per fault kind", "", *fault_kinds_table(kinds), ""]
    return "\n".join(lines)


def update_readme(text: str, readme: Path = README) -> None:
    body = readme.read_text()
    if START not in body or END not in body:
        raise SystemExit(f"{readme} lacks the {START} / {END} markers")
    head, rest = body.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--smoke", action="store_true", help="read the *_smoke.json files")
    p.add_argument("--no-readme", action="store_true", help="print only, leave the README")
    args = p.parse_args(argv)
    results = load(args.results_dir, smoke=args.smoke)
    if not results:
        raise SystemExit(f"no results in {args.results_dir}; run python -m benchmarks.<name>")
    from benchmarks import plots

    titles = {name: TABLES[name][0] for name in results}
    plots.draw_all(results, args.results_dir, suffix="_smoke" if args.smoke else "", titles=titles)
    text = markdown(results, None if args.smoke else args.results_dir / FAULT_KINDS_DIR)
    sys.stdout.write(text + "\n")
    if not (args.smoke or args.no_readme):
        update_readme(text)
        from benchmarks import readme  # it imports this module's tables

        readme.main([f"--results-dir={args.results_dir}"])


if __name__ == "__main__":
    main()
