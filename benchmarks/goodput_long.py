"""Exactly-once soak: ``ours`` on three nodes through up to ``--faults`` SIGKILLs of a
random node (seeded), each followed by that node's rejoin, then trained to its
last step and compared with a fault-free run.

    python -m benchmarks.goodput_long --faults 1000                   # hours
    python -m benchmarks.goodput_long --faults 50                     # results/goodput_long.json
    python -m benchmarks.goodput_long --faults 1000 --steps 220000 --gap-steps 10 \
        --pace-ms 20 --hidden-size 16 --recovery inprocess            # loss stays off zero

``--hidden-size 16`` keeps the loss of the synthetic task around 1 for hundreds of
thousands of steps, so the final loss and parameters can be compared (a wide MLP
memorises the data and reaches a loss of 1e-9, where Adam's update is float noise).
``--pace-ms`` sleeps in every step of the soak: fewer steps a second, so the
fault-free run of the same steps (which does not sleep) takes minutes, not hours.

Each event waits for the previous one's recovery (a step at the expected world
size) and then ``--gap-steps`` more steps, so faults come as fast as the job
recovers and every fault lands on a training job, never on a rendezvous in
progress. The survivors keep training while a rejoining node starts up, so a
fault cycle costs an unpredictable number of steps: faults stop once the job is
within ``--margin-steps`` of ``--steps`` (the count delivered is recorded), and
the job then trains to ``--steps`` and writes its result.

Verdicts: the exactly-once audit over every record
(``elastic_train.audit.audit_exactly_once``), and the final loss and parameters
against one fault-free process trained for the same steps (the trainer is
world-size invariant; summation order differs between world sizes, so the
comparison has a tolerance, ``--loss-rtol``).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.cluster import BenchCluster
from benchmarks.goodput import NODES, recovery_overrides
from benchmarks.workloads import Workload
from elastic_train.audit import RESULT_FILE, AuditLog, audit_exactly_once, read_result
from elastic_train.errors import ClusterError
from elastic_train.local.chaos import ChaosKind
from elastic_train.log import get_logger

log = get_logger(__name__)

#: One fault: a kill leaves the others at NODES - 1, the rejoin brings back NODES.
CYCLE: tuple[tuple[ChaosKind, int], ...] = (("kill", NODES - 1), ("join", NODES))


def faults(
    cluster: BenchCluster, *, count: int, gap: int, last_step: int, seed: int, timeout: float
) -> list[dict[str, Any]]:
    """Kill and rejoin random nodes until ``count`` kills or ``last_step`` is near.

    An event that does not recover within ``timeout`` ends the faults (recorded
    as an ``error`` entry); the job then trains on, so the audit still judges it.
    """
    rng = random.Random(seed)
    done: list[dict[str, Any]] = []
    cluster.wait_step(gap, world_size=NODES, timeout=timeout)
    while len(done) < 2 * count:
        if max(cluster.highest_step.values(), default=0) >= last_step:
            break
        node = rng.randrange(NODES)
        try:
            cycle(cluster, node, gap=gap, timeout=timeout, into=done)
        except ClusterError as exc:
            log.warning("goodput_long_event_failed", node=node, error=str(exc))
            done.append({"kind": "error", "node": node, "error": str(exc)})
            break
        if len(done) % 20 == 0:
            log.info("goodput_long_progress", kills=len(done) // 2)
    return done


def cycle(
    cluster: BenchCluster, node: int, *, gap: int, timeout: float, into: list[dict[str, Any]]
) -> None:
    """Kill ``node``, wait for the survivors' recovery and ``gap`` steps; rejoin it, the
    same. Each recovery goes ``into`` the list as it happens (a later timeout keeps it)."""
    for kind, world in CYCLE:
        moment = cluster.deliver(kind, node)
        rec = cluster.wait_recovery(
            kind=kind, node=node, event_time=moment, world_size=world, timeout=timeout
        )
        into.append(rec.to_json())
        step = max(cluster.highest_step.values())
        cluster.wait_step(step + gap, world_size=world, timeout=timeout)


def finish(cluster: BenchCluster, *, timeout: float) -> dict[str, Any]:
    """Wait for rank 0's result (the job trained every step)."""
    path = cluster.local.audit_dir / RESULT_FILE
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise ClusterError(f"no {RESULT_FILE} within {timeout:.0f}s of the last fault")
        cluster.local.poll()
        time.sleep(0.2)
    result = read_result(cluster.local.audit_dir)
    assert result is not None
    return result


def run_job(workdir: Path, workload: Workload, *, nodes: int, **chaos: Any) -> dict[str, Any]:
    """One job to its end; with ``chaos`` (``faults`` arguments) it is the soak."""
    spec = {"nodes": nodes, "min_nodes": min(nodes, NODES - 1), "max_nodes": nodes}
    comp = harness.COMPETITORS["ours"]
    started = time.monotonic()
    with BenchCluster(comp, workload, workdir, **spec) as cluster:
        cluster.wait_step(1, world_size=nodes, timeout=180.0)
        events = faults(cluster, **chaos) if chaos else []
        result = finish(cluster, timeout=max(600.0, workload.steps / 20))
    audit = AuditLog.load(workdir / "audit")
    verdict = audit_exactly_once(audit, dataset_len=int(result["dataset_len"]))
    return {
        "seconds": time.monotonic() - started,
        "events": events,
        "exactly_once": verdict.to_json(),
        "final_step": result.get("final_step"),
        "final_loss": result.get("final_loss"),
        "params": torch.load(workdir / "audit" / "final_params.pt", weights_only=True),
    }


def compare(soak: dict[str, Any], reference: dict[str, Any], *, rtol: float) -> dict[str, Any]:
    diffs = [float((soak["params"][k] - v).abs().max()) for k, v in reference["params"].items()]
    loss, ref = soak["final_loss"], reference["final_loss"]
    within = loss is not None and ref is not None and abs(loss - ref) <= rtol * abs(ref)
    return {
        "final_loss": loss,
        "fault_free_final_loss": ref,
        "loss_rtol": rtol,
        "loss_within_tolerance": within,
        "max_abs_param_diff": max(diffs),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=1000, help="most SIGKILLs (each then rejoins)")
    p.add_argument("--steps", type=int, default=None, help="default: 900 per fault")
    p.add_argument("--gap-steps", type=int, default=20, help="steps after each recovery")
    p.add_argument("--margin-steps", type=int, default=3000, help="no faults this near the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-rtol", type=float, default=0.01)
    p.add_argument("--event-timeout", type=float, default=120.0)
    harness.add_recovery_argument(p)
    p.add_argument(
        "--pace-ms",
        type=float,
        default=0.0,
        help="a sleep per step in the soak (the fault-free run does not sleep)",
    )
    p.add_argument(
        "--hidden-size",
        type=int,
        default=Workload.hidden_size,
        help="the MLP's width; a narrow one keeps the loss off zero for long runs",
    )
    p.add_argument("--out-dir", type=Path, default=harness.RESULTS_DIR)
    p.add_argument("--workdir", type=Path, default=None, help="scratch (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    steps = args.steps or 900 * args.faults
    overrides, recovery_run = recovery_overrides(args.recovery)
    workload = Workload(steps=steps, ours_overrides=overrides, hidden_size=args.hidden_size,
                        step_seconds=args.pace_ms / 1000.0)  # fmt: skip
    # The sleep changes no number, and without it the reference takes minutes, not hours;
    # the paced model wraps the MLP, so the reference must too (same parameter names).
    fault_free = dataclasses.replace(workload, step_seconds=1e-9 if args.pace_ms else 0.0)
    started, host = time.time(), harness.machine()
    tmp = harness.scratch(args.workdir)
    workdir = Path(tmp.name) if tmp else args.workdir
    try:
        reference = run_job(workdir / "fault-free", fault_free, nodes=1)
        soak = run_job(workdir / "soak", workload, nodes=NODES, count=args.faults,
                       gap=args.gap_steps, last_step=steps - args.margin_steps,
                       seed=args.seed, timeout=args.event_timeout)  # fmt: skip
    finally:
        if tmp:
            tmp.cleanup()
    kills = [e for e in soak["events"] if e["kind"] == "kill"]
    joins = [e for e in soak["events"] if e["kind"] == "join"]
    payload = {
        "benchmark": "goodput_long",
        "started": started,
        "finished": time.time(),
        "machine": host,
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("out_dir", "workdir")},
            "steps": steps,
            "recovery_run": recovery_run,
        },
        "kills_delivered": len(kills),
        "fault_errors": [e["error"] for e in soak["events"] if e["kind"] == "error"],
        "soak_seconds": soak["seconds"],
        "fault_free_seconds": reference["seconds"],
        "final_step": soak["final_step"],
        "exactly_once": soak["exactly_once"],
        **compare(soak, reference, rtol=args.loss_rtol),
        "kill_seconds": harness.summarize([e["seconds"] for e in kills]),
        "kill_lost_steps": harness.summarize([e["lost_steps"] for e in kills]),
        "join_seconds": harness.summarize([e["seconds"] for e in joins]),
        "events": soak["events"],
    }
    harness.write_results("goodput_long", payload, out_dir=args.out_dir)
    return payload


if __name__ == "__main__":
    main()
