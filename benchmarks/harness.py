"""What every benchmark shares: the competitors, A/B/A/B interleaving,
median/min/max, the machine description and the results JSON.

A benchmark defines ``measure(competitor, workdir) -> dict`` for one
repetition; :func:`run_interleaved` calls it for every competitor in turn,
``repeats`` times, inside this one process tree, so machine drift hits all
competitors alike. A competitor that cannot run is kept in the results with
the reason (``unavailable``) instead of being dropped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from elastic_train.log import get_logger

log = get_logger(__name__)

RESULTS_DIR = Path(__file__).resolve().parent / "results"


#: torchrun's knobs turned as far as it allows (integers; 1 s is the minimum).
TUNED_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"


@dataclass(frozen=True)
class Competitor:
    """One way of running elastic training: a rendezvous backend and a script."""

    name: str
    rdzv_backend: str
    rdzv_conf: str = ""
    ours: bool = False
    #: Extra environment for the agents, e.g. torch's shared-TCPStore opt-out.
    env: tuple[tuple[str, str], ...] = ()

    @property
    def needs_etcd_v2(self) -> bool:
        return self.rdzv_backend == "etcd-v2"

    @property
    def needs_etcd(self) -> bool:
        return self.ours or self.needs_etcd_v2

    def unavailable(self) -> str | None:
        """Why this competitor cannot run here, or None."""
        if self.ours:
            missing = [m for m in _OURS_MODULES if importlib.util.find_spec(m) is None]
            return f"elastic_train modules not landed yet: {missing}" if missing else None
        if self.needs_etcd_v2 and importlib.util.find_spec("etcd") is None:
            return "python-etcd is not installed (pip install python-etcd)"
        return None


_OURS_MODULES = ("elastic_train.rendezvous.backend", "elastic_train.main")
_NO_SHARED_STORE = (("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),)

COMPETITORS: dict[str, Competitor] = {
    c.name: c
    for c in (
        Competitor("ours", "etcd-v3", ours=True),
        Competitor("c10d-default", "c10d"),
        Competitor("c10d-tuned", "c10d", TUNED_CONF, env=_NO_SHARED_STORE),
        Competitor("etcd-v2-default", "etcd-v2"),
        Competitor("etcd-v2-tuned", "etcd-v2", TUNED_CONF, env=_NO_SHARED_STORE),
    )
}


def summarize(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, 95th percentile, min, max and count of the measured values (None = not
    measured). p95 interpolates between the sorted values, so with 5 runs it lies
    between the two largest."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "p95": None, "min": None, "max": None, "n": 0}
    p95 = statistics.quantiles(xs, n=20, method="inclusive")[18] if len(xs) > 1 else xs[0]
    return {
        "median": statistics.median(xs),
        "p95": p95,
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator in (None, 0):
        return None
    return numerator / denominator


def machine() -> dict[str, Any]:
    """The machine a result came from; absolute times mean little without it."""
    model = platform.processor() or ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load1, _, _ = os.getloadavg() if hasattr(os, "getloadavg") else (None, None, None)
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "loadavg_1m_at_start": load1,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


@dataclass
class Outcome:
    """Every repetition of one competitor."""

    competitor: str
    unavailable: str | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)


class Contender(Protocol):
    """Anything that can be measured A/B: a Competitor, or a variant of one setup."""

    @property
    def name(self) -> str: ...

    def unavailable(self) -> str | None: ...


Measure = Callable[[Any, Path], dict[str, Any]]


def run_interleaved(
    competitors: Sequence[Contender], *, repeats: int, measure: Measure, workdir: Path
) -> dict[str, Outcome]:
    """Run ``measure`` A/B/A/B: repetition r of every competitor before r+1.

    An exception in one repetition is recorded as that run's ``error`` and the
    others go on, so one hang does not cost a whole benchmark.
    """
    outcomes = {c.name: Outcome(c.name, c.unavailable()) for c in competitors}
    for rep in range(repeats):
        for comp in competitors:
            outcome = outcomes[comp.name]
            if outcome.unavailable:
                continue
            rundir = workdir / f"{comp.name}-{rep}"
            rundir.mkdir(parents=True)
            started = time.monotonic()
            try:
                run = measure(comp, rundir)
            except Exception as exc:
                log.warning("benchmark_run_failed", competitor=comp.name, error=repr(exc))
                run = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            run["repeat"] = rep
            run["wall_seconds"] = time.monotonic() - started
            outcome.runs.append(run)
            log.info("benchmark_run", competitor=comp.name, **_scalars(run))
    return outcomes


def _scalars(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if isinstance(v, int | float | str) and k != "trace"}


def summarize_outcomes(
    outcomes: dict[str, Outcome], metrics: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Per competitor: every metric's median/min/max over its runs."""
    out: dict[str, dict[str, Any]] = {}
    for name, outcome in outcomes.items():
        entry: dict[str, Any] = {"unavailable": outcome.unavailable}
        for metric in metrics:
            entry[metric] = summarize([r.get(metric) for r in outcome.runs])
        entry["errors"] = [r["error"] for r in outcome.runs if "error" in r]
        out[name] = entry
    return out


def write_results(name: str, payload: dict[str, Any], *, out_dir: Path | None = None) -> Path:
    """Write ``{out_dir}/{name}.json`` (atomically) and return its path."""
    directory = out_dir or RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)
    log.info("benchmark_results_written", path=str(path))
    return path


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Outcome):
        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def base_parser(description: str, *, default_repeats: int) -> argparse.ArgumentParser:
    """The options every benchmark takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--repeats", type=int, default=default_repeats, help="repetitions")
    p.add_argument(
        "--competitors",
        default=",".join(COMPETITORS),
        help=f"comma-separated subset of {','.join(COMPETITORS)}",
    )
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    p.add_argument("--workdir", type=Path, default=None, help="scratch (default: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="a few-seconds version for CI")
    p.add_argument(
        "--rdzv-conf", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="add or replace rdzv-conf keys of competitor NAME, e.g. "
             "c10d-tuned:keep_alive_max_attempt=5 (repeatable; the results record "
             "every competitor's conf)",
    )  # fmt: skip
    return p


#: ``--recovery``: ours' ``elastic.recovery``. "auto", the product's default, runs
#: in process under our torchrun plugin (torch >= 2.8), so a default run measures
#: what a user gets.
RECOVERY_MODES = ("auto", "inprocess", "restart")


def add_recovery_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--recovery", choices=RECOVERY_MODES, default="auto",
        help="ours' elastic.recovery (default: auto, the product's default)",
    )  # fmt: skip


def select_competitors(spec: str, overrides: Sequence[str] = ()) -> list[Competitor]:
    """The competitors ``spec`` names, with ``--rdzv-conf`` ``overrides`` applied."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in COMPETITORS]
    if unknown:
        raise SystemExit(
            f"--competitors: unknown {unknown}; accepted values: {', '.join(COMPETITORS)}"
        )
    confs = {n: _conf_dict(COMPETITORS[n].rdzv_conf) for n in names}
    for override in overrides:
        name, sep, pairs = override.partition(":")
        keys = _conf_dict(pairs) if sep else None
        if name not in confs or not keys:
            raise SystemExit(
                f"--rdzv-conf {override!r}: expected NAME:KEY=VALUE[,KEY=VALUE] with NAME "
                f"one of the selected competitors ({', '.join(names)})"
            )
        confs[name].update(keys)
    return [
        replace(COMPETITORS[n], rdzv_conf=",".join(f"{k}={v}" for k, v in confs[n].items()))
        for n in names
    ]


def _conf_dict(conf: str) -> dict[str, str]:
    """``"a=1,b=2"`` as a dict; a pair without ``=`` (or with an empty key) yields {}."""
    pairs = [kv.partition("=") for kv in conf.split(",") if kv.strip()]
    if any(not sep or not key.strip() for key, sep, _ in pairs):
        return {}
    return {key.strip(): value.strip() for key, _, value in pairs}


def scratch(workdir: Path | None) -> tempfile.TemporaryDirectory[str] | None:
    """A temporary scratch directory unless the user named one."""
    return None if workdir else tempfile.TemporaryDirectory(prefix="bench-")


@dataclass(frozen=True)
class Target:
    """A goal from the issue, checked against the measured summary."""

    name: str
    value: float | None
    limit: float
    #: "max": value <= limit is met; "min": value >= limit is met.
    kind: str = "max"

    def to_json(self) -> dict[str, Any]:
        met = None
        if self.value is not None:
            met = self.value <= self.limit if self.kind == "max" else self.value >= self.limit
        return {
            "name": self.name,
            "value": self.value,
            "limit": self.limit,
            "kind": self.kind,
            "met": met,
        }


def add_paired_ratios(
    summary: dict[str, dict[str, Any]],
    outcomes: dict[str, Outcome],
    *,
    metric: str,
    reference: str = "ours",
) -> None:
    """``summary[name]["paired_ratio"]``: ``metric`` of each repetition of a
    competitor divided by the reference's in the same repetition, summarized.

    Repetition r of every competitor runs back to back (``run_interleaved``),
    so a pair shares the machine's state of that minute: drift slower than a
    pair cancels in its ratio, and the pairs' spread shows how far a single
    comparison moves on this machine.
    """
    ref = (
        {r["repeat"]: r.get(metric) for r in outcomes[reference].runs}
        if reference in outcomes
        else {}
    )
    for name, outcome in outcomes.items():
        pairs = [ratio(r.get(metric), ref.get(r["repeat"])) for r in outcome.runs]
        summary[name]["paired_ratio"] = summarize(pairs)


def headline_ratios(
    summary: dict[str, dict[str, Any]], *, metric: str, reference: str = "ours"
) -> dict[str, float | None]:
    """Each competitor's median of ``metric`` divided by the reference's median."""
    ref = summary.get(reference, {}).get(metric, {}).get("median")
    return {
        name: ratio(entry.get(metric, {}).get("median"), ref) for name, entry in summary.items()
    }


def run_benchmark(
    name: str,
    args: argparse.Namespace,
    competitors: Sequence[Contender],
    *,
    measure: Measure,
    metrics: Sequence[str],
    headline: str,
    targets: Callable[[dict[str, dict[str, Any]]], list[Target]],
    settings: dict[str, Any],
    reference: str = "ours",
) -> dict[str, Any]:
    """Interleave, summarize, check targets and write ``{name}.json``.

    ``ratios`` divide each contender's median ``headline`` by ``reference``'s;
    each summary's ``paired_ratio`` does so repetition by repetition.
    """
    started = time.time()
    host = machine()
    tmp = scratch(args.workdir)
    workdir = Path(tmp.name) if tmp else args.workdir
    try:
        outcomes = run_interleaved(
            competitors, repeats=args.repeats, measure=measure, workdir=workdir
        )
    finally:
        if tmp:
            tmp.cleanup()
    summary = summarize_outcomes(outcomes, metrics)
    add_paired_ratios(summary, outcomes, metric=headline, reference=reference)
    payload = {
        "benchmark": name,
        "started": started,
        "finished": time.time(),
        "machine": host,
        "repeats": args.repeats,
        "settings": settings,
        "rdzv_conf": {c.name: c.rdzv_conf for c in competitors if isinstance(c, Competitor)},
        "headline_metric": headline,
        "reference": reference,
        "ratios": headline_ratios(summary, metric=headline, reference=reference),
        "targets": [t.to_json() for t in targets(summary)],
        "summary": summary,
        "runs": {n: asdict(o) for n, o in outcomes.items()},
    }
    write_results(name, payload, out_dir=args.out_dir)
    return payload


def median_of(summary: dict[str, dict[str, Any]], competitor: str, metric: str) -> float | None:
    return summary.get(competitor, {}).get(metric, {}).get("median")
