"""``run_local``: an elastic job on one machine, with chaos, audited.

An embedded etcd, ``nodes`` torchrun agents, an optional chaos schedule, live
progress, and a summary audited from the workers' per-step records (see
docs/DESIGN.md)::

    spec = ClusterSpec(nodes=3, chaos=parse_schedule("kill:1@20s,join:1@40s"))
    summary = run_local(spec, run_dir="runs/demo")
    assert summary.exactly_once

It is also the harness of the end-to-end tests and the benchmarks: any worker
script (``script``/``script_args``, with ``trainer_args=False``) and any
rendezvous backend (``etcd``/``etcd-v3``, ``etcd-v2``, ``c10d``).

Run directory: ``audit/`` (records, result.json, final_params.pt),
``checkpoints/``, ``logs/node<i>.log`` (agent and worker output, appended
across restarts), ``summary.json`` and ``timeline.png`` (local/timeline.py).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from elastic_train.audit import (
    RESULT_FILE,
    AuditLog,
    AuditTail,
    ExactlyOnce,
    StepRecord,
    audit_exactly_once,
    read_result,
)
from elastic_train.config.args import parse_cli
from elastic_train.config.load import to_toml
from elastic_train.errors import EXIT_CONFIG_ERROR
from elastic_train.etcd.server import find_etcd_binary
from elastic_train.local.chaos import (
    SAVE_WATCH_S,
    ChaosEvent,
    Recovery,
    freeze_if_saving,
    held_back,
    kill_workers_together,
    node_of_rank,
    recovery_after,
)
from elastic_train.local.cluster import ETCD_BACKENDS, ClusterSpec, LocalCluster, Node
from elastic_train.local.progress import ProgressBoard, ProgressSink, trainer_training
from elastic_train.local.timeline import TIMELINE_FILE, write_timeline
from elastic_train.log import get_logger

__all__ = ["Delivery", "Summary", "effective_config_toml", "run_local"]

log = get_logger(__name__)

#: seconds between two supervision ticks (records read, events due, agents reaped)
POLL_INTERVAL_S = 0.2

#: seconds the nodes get to exit once the trainer wrote its result (ClusterSpec's default)
FINISH_GRACE_S = 15.0


@dataclass(frozen=True)
class Delivery:
    """A chaos event as carried out: wall ``time``, seconds since start, outcome."""

    event: ChaosEvent
    #: the node it hit (a rank target resolved), None if it was never due
    node: int | None
    time: float
    elapsed: float
    outcome: str
    #: what the runner saw as it struck, e.g. the partial save a ``@save`` kill interrupted
    detail: str = ""

    @property
    def delivered(self) -> bool:
        return self.outcome == "delivered"

    def to_json(self) -> dict[str, object]:
        return {
            "event": str(self.event),
            "node": self.node,
            "time": self.time,
            "elapsed": self.elapsed,
            "outcome": self.outcome,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class Summary:
    """The outcome of one local run; ``to_json()`` is the ``--json`` document."""

    completed: bool
    final_step: int | None
    final_loss: float | None
    exactly_once: bool
    exactly_once_detail: str
    recoveries: list[Recovery]
    events: list[Delivery]
    nodes: dict[str, str]
    wall_seconds: float
    run_dir: str
    dataset_len: int | None
    samples_per_second: float | None
    error: str | None = None
    result: dict[str, Any] = field(default_factory=dict)
    #: the run's ``timeline.png`` (None: not drawn); not in ``to_json()``, which stays as it was
    timeline: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "completed": self.completed,
            "final_step": self.final_step,
            "final_loss": self.final_loss,
            "exactly_once": self.exactly_once,
            "exactly_once_detail": self.exactly_once_detail,
            "recoveries": [r.to_json() for r in self.recoveries],
            "events": [e.to_json() for e in self.events],
            "nodes": self.nodes,
            "wall_seconds": self.wall_seconds,
            "run_dir": self.run_dir,
            "dataset_len": self.dataset_len,
            "samples_per_second": self.samples_per_second,
            "error": self.error,
            "result": self.result,
        }

    def write(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def run_local(
    spec: ClusterSpec,
    *,
    run_dir: str | Path | None = None,
    progress: ProgressSink | None = None,
    json_path: str | Path | None = None,
    timeline: bool = True,
) -> Summary:
    """Run the job to its end (or ``spec.timeout_s``); everything started is stopped.

    The summary goes to ``run_dir/summary.json`` and ``json_path``, also when
    the run is interrupted (Ctrl-C, SIGTERM): the interruption is re-raised
    after everything is stopped and what was audited so far is written.
    ``timeline``: draw ``run_dir/timeline.png`` at the end (local/timeline.py).
    """
    if spec.rdzv_endpoint is None and spec.rdzv_backend in ETCD_BACKENDS:
        find_etcd_binary()  # no etcd: say how to install it before making anything
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir()
    started = time.monotonic()
    cluster = LocalCluster(spec, run_dir=run_dir)
    supervisor = _Supervisor(cluster, progress)
    interrupted: BaseException | None = None
    with cluster:
        try:
            error = supervisor.run()
        except (KeyboardInterrupt, SystemExit) as exc:
            interrupted, error = exc, "interrupted"
    supervisor.draw(final=True)
    summary = summarize(
        cluster, supervisor.deliveries, error=error, wall_seconds=time.monotonic() - started
    )
    for path in (run_dir / "summary.json", json_path):
        if path is not None:
            summary.write(path)
    if timeline:
        # supervisor.elapsed counts from the nodes' start: the origin of the chaos times.
        origin = time.time() - supervisor.elapsed
        drawn = write_timeline(
            cluster.audit_dir, summary.recoveries, origin=origin, path=run_dir / TIMELINE_FILE
        )
        summary = replace(summary, timeline=None if drawn is None else str(drawn))
    log.info("local_run_finished", completed=summary.completed, run_dir=str(run_dir))
    if interrupted is not None:
        raise interrupted
    return summary


def default_run_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="elastic-train-local-"))


#: what ``--print-config`` shows for a run dir not chosen yet
RUN_DIR_PLACEHOLDER = "<run-dir>"


def effective_config_toml(spec: ClusterSpec, *, run_dir: str | Path | None) -> str:
    """The trainer config the workers of ``run_local(spec, run_dir=...)`` get, as TOML.

    Reads the ``--config`` file and applies the overrides and the runner's own
    settings (the audit and checkpoint dirs in the run dir) exactly as the run
    would, and starts nothing: no run dir, etcd or agent. The cluster's settings
    head it as TOML comments, so the text still loads as a ``--config`` file.
    """
    cluster = LocalCluster(spec, run_dir=run_dir or RUN_DIR_PLACEHOLDER)
    config = parse_cli(cluster.worker_args()).config
    chaos = ",".join(str(event) for event in spec.chaos) or "none"
    new_dir = f"a new elastic-train-local-* directory in {tempfile.gettempdir()}"
    where = str(run_dir) if run_dir else f"{RUN_DIR_PLACEHOLDER}: {new_dir}"
    header = [
        "# elastic-train local: the trainer config every worker gets",
        f"# nodes {spec.nodes} x {spec.nproc_per_node} process(es), --nnodes {spec.nnodes}, "
        f"rdzv backend {spec.rdzv_backend}, chaos {chaos}",
        f"# run dir {where}",
        f"# GPUs: {cluster.gpus.reason}",
        "",
    ]
    return "\n".join(header) + to_toml(config)


class _Supervisor:
    """The tick loop: read new records, fire due events, notice the end."""

    def __init__(self, cluster: LocalCluster, progress: ProgressSink | None) -> None:
        self.cluster = cluster
        self.progress = progress
        self.tail = AuditTail(cluster.audit_dir)
        self.board = ProgressBoard(training=trainer_training(cluster))
        self.pending = list(cluster.spec.chaos)
        self.deliveries: list[Delivery] = []
        self.started = time.monotonic()
        self._result_file = cluster.audit_dir / RESULT_FILE
        self._finished_at: float | None = None
        #: a fault landed while later step events were due: those wait for a newer step
        self._settle_from: float | None = None
        self._last_step_time = 0.0
        #: when (``elapsed``) each step event was first seen due, for its ``after_seconds``
        self._step_reached: dict[ChaosEvent, float] = {}

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def run(self) -> str | None:
        """Returns an error message when the run had to be cut short."""
        timeout = self.cluster.spec.timeout_s
        self.started = time.monotonic()  # chaos times count from the nodes' start
        error = None
        while True:
            records = self.tail.poll()
            self.board.observe(records)
            steps = [r.time for r in records if isinstance(r, StepRecord)]
            self._last_step_time = max([self._last_step_time, *steps])
            self._fire_due_events()
            self.cluster.poll()
            if self._finished_at is None and self._result_file.exists():
                self._finished_at = time.monotonic()
                self.cluster.job_finished = True
            if not self.cluster.alive_nodes() and not self._join_pending():
                break
            grace = self.cluster.spec.finish_grace_s
            if self._finished_at is not None and self._since_finish() > grace:
                # Typically a late joiner waiting for a round that will never come.
                log.warning("local_nodes_left_after_finish", grace_s=grace)
                break
            if self.elapsed > timeout:
                error = f"timed out after {timeout:g}s"
                break
            self.draw()
            time.sleep(POLL_INTERVAL_S)
        for event in self.pending:
            self.deliveries.append(
                Delivery(event, event.node, time.time(), self.elapsed, "not reached")
            )
        return error

    def _since_finish(self) -> float:
        assert self._finished_at is not None
        return time.monotonic() - self._finished_at

    def _join_pending(self) -> bool:
        """A timed join can revive a job whose nodes are all gone (a whole-job restart)."""
        if self._finished_at is not None:
            return False
        return any(e.kind == "join" and e.at_seconds is not None for e in self.pending)

    def _fire_due_events(self) -> None:
        if self._finished_at is not None:
            return  # the job is done: faults and joins could only disturb the shutdown
        elapsed = self.elapsed
        due: list[tuple[ChaosEvent, int, str]] = []
        unresolved_kill = False
        settling = self._settle_from is not None and self._last_step_time <= self._settle_from
        for event in [e for e in self.pending if e.is_due(elapsed=elapsed, step=self.board.step)]:
            if held_back(event, self.pending) or (settling and event.by_step):
                continue
            # stepN+Xs: X seconds from the tick that first saw step N
            if elapsed < self._step_reached.setdefault(event, elapsed) + event.after_seconds:
                continue
            node = event.node
            if node is None:
                node = node_of_rank(self.tail.log, event.rank)  # type: ignore[arg-type]
                if node is None:  # no worker has recorded that rank yet
                    unresolved_kill |= event.kind == "kill"
                    continue
            partial = self._mid_save(node) if event.on_save else ""
            if event.on_save and not partial:
                continue  # not saving now: the next tick looks again
            due.append((event, node, partial))
        if unresolved_kill:  # kills due together wait for each other's targets
            due = [d for d in due if d[0].kind != "kill" or d[0].on_save]
        # Several events at once: every kill strikes first, within milliseconds, so a
        # second kill or a join lands while the first one's recovery has only begun.
        strike = {n for e, n, _ in due if e.kind == "kill"} if len(due) > 1 else set()
        killed = self._kill_together(strike)
        faults = False
        for event, node, partial in due:
            now = killed.get(node, time.time())
            outcome = self.cluster.deliver(replace(event, node=node, rank=None))
            if outcome is None:
                continue
            self.pending.remove(event)
            faults |= event.kind != "join"
            detail = f"partial save {partial}" if partial else ""
            self.deliveries.append(Delivery(event, node, now, elapsed, outcome, detail))
            log.info("chaos_event", chaos=str(event), outcome=outcome, elapsed=round(elapsed, 2),
                     detail=detail)  # fmt: skip
        backlog = any(e.by_step and e.is_due(elapsed=elapsed, step=self.board.step)
                      for e in self.pending)  # fmt: skip
        if faults and backlog:  # the next ones' rank targets must see the recovered group
            self._settle_from = time.time()

    def _agent_pid(self, node: int) -> int | None:
        running = self.cluster.nodes.get(node)
        return running.proc.pid if running is not None and running.alive else None

    def _mid_save(self, node: int) -> str:
        """The partial save file the frozen ``node`` writes ("": none, node thawed)."""
        pid = self._agent_pid(node)
        partial = None
        if pid is not None:
            partial = freeze_if_saving(pid, self.cluster.checkpoint_dir, watch_s=SAVE_WATCH_S)
        return partial or ""

    def _kill_together(self, nodes: set[int]) -> dict[int, float]:
        """SIGKILL the trainers of ``nodes`` now; their agents stay frozen (chaos.py)."""
        pids = {node: self._agent_pid(node) for node in nodes}
        return kill_workers_together({node: pid for node, pid in pids.items() if pid is not None})

    def draw(self, *, final: bool = False) -> None:
        if self.progress is None:
            return
        if final:  # the last node may have exited after the last tick read the records
            self.board.observe(self.tail.poll(everything=True))
        states = {node.name: self._state(node) for node in self.cluster.nodes.values()}
        view = self.board.view(
            states, elapsed=self.elapsed, deliveries=self.deliveries, log=self.tail.log
        )
        self.progress.show(view, final=final)

    def _state(self, node: Node) -> str:
        state = node.state()
        if state != "running":
            return state
        # Until its workers record a step, a node is starting or in a rendezvous.
        training = self.board.has_records_since(node.name, node.started_at)
        return "training" if training else "starting"


def _config_error(cluster: LocalCluster) -> str | None:
    """The configuration error that ended a node's agent (its workers' ``config_error``,
    which a restart cannot fix: agent/verdict.py), as the run's error."""
    for node in cluster.nodes.values():
        if node.alive or node.proc.returncode != EXIT_CONFIG_ERROR:
            continue
        log_file = cluster.run_dir / "logs" / f"{node.name}.log"
        lines = log_file.read_text(errors="replace").splitlines() if log_file.exists() else []
        for line in reversed(lines):
            if line.startswith("{") and '"worker_config_error"' in line:
                with contextlib.suppress(ValueError):
                    return f"{node.name}: configuration error: {json.loads(line)['error']}"
        return f"{node.name}: its agent exited with a configuration error (see its log)"
    return None


def summarize(
    cluster: LocalCluster,
    deliveries: list[Delivery],
    *,
    error: str | None,
    wall_seconds: float,
) -> Summary:
    """Audit the finished run from its records and result."""
    audit = AuditLog.load(cluster.audit_dir)
    result = read_result(cluster.audit_dir) or {}
    dataset_len = result.get("dataset_len") or audit.dataset_len()
    if dataset_len is None:
        verdict = ExactlyOnce(False, "dataset_len is in neither result.json nor a resume record")
    else:
        verdict = audit_exactly_once(audit, dataset_len=int(dataset_len))
    recoveries = [
        recovery_after(audit, kind=d.event.kind, node=d.node, event_time=d.time)  # type: ignore[arg-type]
        for d in deliveries
        if d.delivered
    ]
    nodes = {node.name: node.state() for node in cluster.nodes.values()}
    if error is None and not result:
        error = _config_error(cluster)
    return Summary(
        completed=error is None and _completed(cluster, bool(result)),
        final_step=result.get("final_step", max((r.step for r in audit.steps), default=None)),
        final_loss=result.get("final_loss"),
        exactly_once=verdict.ok,
        exactly_once_detail=verdict.detail,
        recoveries=recoveries,
        events=deliveries,
        nodes=nodes,
        wall_seconds=wall_seconds,
        run_dir=str(cluster.run_dir),
        dataset_len=None if dataset_len is None else int(dataset_len),
        samples_per_second=_samples_per_second(audit),
        error=error,
        result=result,
    )


def _completed(cluster: LocalCluster, has_result: bool) -> bool:
    """Our trainer wrote its result; any other script: every agent left alone exited 0.

    Rank 0 writes the result only once the configured steps are done. A node
    failing on the way (or a late joiner turned away) shows in ``nodes``.
    """
    if cluster.spec.trainer_args:
        return has_result
    left_alone = [n for n in cluster.nodes.values() if n.fate not in ("killed", "terminated")]
    return bool(left_alone) and all(n.proc.returncode == 0 for n in left_alone)


def _samples_per_second(audit: AuditLog) -> float | None:
    """Samples of every recorded step (redone ones too) over the span of the records."""
    if len(audit.steps) < 2:
        return None
    times = [r.time for r in audit.steps]
    span = max(times) - min(times)
    return sum(len(r.indices) for r in audit.steps) / span if span > 0 else None
