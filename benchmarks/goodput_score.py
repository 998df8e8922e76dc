"""Goodput from the goodput soak's runs (``benchmarks.goodput``), and a rescore of a
results file without running anything again:

    python -m benchmarks.goodput_score benchmarks/results/goodput.json

Three denominators, each a fault-free steps/s (1 / mean step time) of the same
competitor; where 2 workers step faster than 3 (fewer cores than workers), the
faster world's rate is the one used, so a dead node's absence is never a gain:

- ``goodput`` (the headline): the *quiet segments of the soak itself*: the last
  ``QUIET_FRACTION`` of every interval between two events (at least 20 s after
  the previous event at the default 30 s), at the world size of that interval,
  where every 1 s bin made progress (a segment with a stall is still recovering).
  They share the soak's minutes, so load from other processes on a shared
  machine (which moved a fault-free run between 30 and 130 steps/s here)
  cancels. A recovery that leaves the job slow for longer than two thirds of an
  interval would be forgiven in part; ours and torchrun both run at full speed
  a second after their first step.
- ``goodput_separate_run``: separate fault-free runs at 3 and 2 nodes, back to
  back with the soaks in the same repetition.
- ``goodput_full_world``: the separate 3-node run only (the issue's literal
  definition, which credits the missing node on a machine like this one).
- ``goodput_world_weighted``: useful steps over what a recovery that costs
  nothing would make, each interval at the quiet rate of the world size the
  schedule gives it (:func:`world_weighted`); on a machine where the rate does
  not depend on the world size it equals ``goodput``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks import harness

NODES = 3
TARGET_GOODPUT = 0.98
#: the part of each interval between two events that counts as fault-free
QUIET_FRACTION = 1 / 3

METRICS = (
    "goodput",
    "goodput_separate_run",
    "goodput_full_world",
    "goodput_world_weighted",
    "useful_steps",
    "useful_steps_per_second",
    "fault_free_steps_per_second",
    "separate_run_steps_per_second",
    "recorded_steps",
    "kills",
    "kill_seconds",
    "join_seconds",
    "kill_max_lost_steps",
)


def _intervals(
    run: dict[str, Any], schedule: list[dict[str, Any]]
) -> list[tuple[float, float, int]]:
    """(start, end, world size the schedule gives) of each interval between two events."""
    ends = [e["at_seconds"] for e in schedule] + [run["window_seconds"]]
    starts = [0.0, *ends[:-1]]
    worlds = [NODES] + [NODES - 1 if e["kind"] == "kill" else NODES for e in schedule]
    return list(zip(starts, ends, worlds, strict=True))


def quiet_rates(run: dict[str, Any], schedule: list[dict[str, Any]]) -> dict[int, float]:
    """Steps/s per world size over the quiet end of each interval of the soak."""
    bins, width = run["steps_per_bin"], run["bin_seconds"]
    steps: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for start, end, world in _intervals(run, schedule):
        first = round((end - (end - start) * QUIET_FRACTION) / width)
        last = round(end / width)
        if not all(bins[first:last]):
            continue  # still recovering (or stuck): not a fault-free rate
        steps[world] = steps.get(world, 0) + sum(bins[first:last])
        seconds[world] = seconds.get(world, 0.0) + (last - first) * width
    return {w: steps[w] / seconds[w] for w in steps if seconds[w] > 0}


def world_weighted(
    run: dict[str, Any], schedule: list[dict[str, Any]], quiet: dict[int, float]
) -> float | None:
    """Useful steps over the steps of a recovery that costs nothing: every interval at
    the quiet rate of the world size the schedule gives it (a rejoined node counts
    from its event on). On fewer cores than workers the rate depends on the world
    size, which ``goodput``'s single denominator charges to the faults."""
    expected = 0.0
    for start, end, world in _intervals(run, schedule):
        if world not in quiet:
            return None
        expected += (end - start) * quiet[world]
    return harness.ratio(run.get("useful_steps"), expected)


def _separate_rates(payload: dict[str, Any], name: str) -> dict[int, dict[int, float]]:
    """repeat -> world size -> steps/s of the separate fault-free runs of ``name``."""
    rates: dict[int, dict[int, float]] = {}
    for nodes in payload["settings"]["fault_free_worlds"]:
        key = f"{name}-fault-free" + ("" if nodes == NODES else f"-{nodes}")
        for r in payload["runs"].get(key, {}).get("runs", []):
            if r.get("useful_steps_per_second"):
                rates.setdefault(r["repeat"], {})[nodes] = r["useful_steps_per_second"]
    return rates


def score_run(
    run: dict[str, Any], schedule: list[dict[str, Any]], separate: dict[int, float]
) -> None:
    """Fill one soak run's goodput fields in place."""
    useful = run.get("useful_steps_per_second")
    if useful is None:
        return
    quiet = quiet_rates(run, schedule)
    run["quiet_steps_per_second"] = {str(w): r for w, r in quiet.items()}
    run["fault_free_steps_per_second"] = max(quiet.values(), default=None)
    run["goodput"] = harness.ratio(useful, run["fault_free_steps_per_second"])
    run["separate_run_steps_per_second"] = max(separate.values(), default=None)
    run["goodput_separate_run"] = harness.ratio(useful, run["separate_run_steps_per_second"])
    run["goodput_full_world"] = harness.ratio(useful, separate.get(NODES))
    run["goodput_world_weighted"] = world_weighted(run, schedule, quiet)


def targets(summary: dict[str, dict[str, Any]]) -> list[harness.Target]:
    ours = harness.median_of(summary, "ours", "goodput")
    return [harness.Target("ours goodput, a kill or a rejoin every 30 s", ours, 0.98, "min")]


def score(payload: dict[str, Any]) -> dict[str, Any]:
    """Goodput of every soak run, then the summary, ratios and targets, in place."""
    schedule = payload["settings"]["schedule"]
    soaks = [n for n in payload["runs"] if "-fault-free" not in n]
    for name in soaks:
        separate = _separate_rates(payload, name)
        for run in payload["runs"][name]["runs"]:
            score_run(run, schedule, separate.get(run["repeat"], {}))
    outcomes = {
        n: harness.Outcome(n, o["unavailable"], o["runs"]) for n, o in payload["runs"].items()
    }
    summary = harness.summarize_outcomes(outcomes, METRICS)
    payload["summary"] = summary
    payload["ratios"] = harness.headline_ratios(summary, metric="goodput")
    payload["targets"] = [t.to_json() for t in targets(summary)]
    return payload


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", type=Path, help="a goodput results JSON, rewritten in place")
    args = p.parse_args(argv)
    payload = score(json.loads(args.path.read_text()))
    harness.write_results(args.path.stem, payload, out_dir=args.path.parent)


if __name__ == "__main__":
    main()
