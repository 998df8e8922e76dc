"""The chaos schedule of ``elastic-train local`` and what each event cost.

A schedule is a comma-separated list of ``KIND:NODE@WHEN`` events::

    kill:1@20s,join:1@40s,term:2@step30,stop:0@12.5s

``WHEN`` is either seconds since the nodes were started (``20s``) or the first
moment the training reached a completed step (``step30``), optionally plus
seconds (``step30+0.5s``). Step triggers make tests independent of how fast a
shared 2-core machine happens to be. A step counts as reached once every rank
recorded it, which a rank does before the step's gradient all-reduce; the
delay lets a fault land in what follows the step (an evaluation) rather than
in the step's last milliseconds.

``save`` (or ``step30+save``: not before step 30), for kills only, fires while
the target node is writing a disk checkpoint: the runner stops the process that
holds a file of an unfinished save open, then freezes and kills the node
(:func:`freeze_if_saving`); when no process is caught writing, it tries again
on the next tick. So ``kill:rank0@save`` lands inside the checkpoint writer's save,
never just before or after it. Until it lands, the events triggered at later
steps wait (:func:`held_back`): ``kill:rank0@step16+save,stop:rank1@step45``
never stops a worker before the kill caught its save. When such a late event
lands while later ones are already due, those wait until the training records
a step after it, so a rank target resolves in the group that recovered from it.
Events triggered by time do not wait.

When several events are due at the same tick, every kill among them strikes
first (:func:`kill_workers_together`): the targets are frozen, then the trainers
of all of them are SIGKILLed within milliseconds; then the events are carried
out in schedule order. So ``kill:rank1@step30,kill:rank2@step30`` are two kills
milliseconds apart, and ``join:4@step8,kill:rank0@step8`` starts node 4 while
the survivors of the kill have just begun to recover. Kills due together also
wait for each other: while one's rank target is not in the newest attempt yet
(say rank 2 of a world that is still 2), none of them strikes.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

from elastic_train.audit import AuditLog
from elastic_train.errors import ConfigError
from elastic_train.local import proctree

ChaosKind = Literal["kill", "join", "term", "stop"]
KINDS: tuple[ChaosKind, ...] = ("kill", "join", "term", "stop")

_FORMS = (
    "accepted forms: KIND:NODE@SECONDSs (e.g. kill:1@20s) or KIND:NODE@stepN "
    f"(e.g. join:1@step30), KIND one of {', '.join(KINDS)}, NODE a node index >= 0 "
    "or rankN, the node that runs global rank N (e.g. kill:rank0@step10; not for join), "
    "WHEN may also be stepN+SECONDSs (e.g. kill:1@step10+0.5s: that long after step N), "
    "or save or stepN+save: while the node writes a checkpoint, not before step N "
    "(kill only, e.g. kill:rank0@step20+save)"
)
_EVENT = re.compile(r"^(?P<kind>[a-z]+):(?P<target>\d+|rank\d+)@(?P<when>.+)$")
_SECONDS = re.compile(r"^(?P<value>\d+(?:\.\d+)?)s$")
_STEP = re.compile(r"^step(?P<value>\d+)(?:\+(?P<delay>\d+(?:\.\d+)?)s)?$")
_SAVE = re.compile(r"^(?:step(?P<value>\d+)\+)?save$")
#: the directories of an unfinished checkpoint save (state/checkpoint.py)
PARTIAL_SAVE_GLOB = ".tmp-step-*"
#: seconds a supervision tick watches for a save while a save trigger is armed
SAVE_WATCH_S = 0.3


@dataclass(frozen=True)
class ChaosEvent:
    """One scheduled fault or join.

    Exactly one of ``at_seconds``/``at_step`` is set, and exactly one of
    ``node``/``rank``: a rank target is resolved when the event is due, to the
    node whose worker holds that global rank in the newest attempt.
    """

    kind: ChaosKind
    node: int | None
    at_seconds: float | None = None
    at_step: int | None = None
    rank: int | None = None
    #: due only while the target writes a checkpoint (``at_step``: not before that step)
    on_save: bool = False
    #: seconds after ``at_step`` was reached (``stepN+Xs``)
    after_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"chaos kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if (self.node is None) == (self.rank is None):
            raise ConfigError("a chaos event needs exactly one of node or rank")
        if self.kind == "join" and self.node is None:
            raise ConfigError("a join starts a node by index; rank targets are for kill/term/stop")
        target = self.node if self.node is not None else self.rank
        if target is not None and target < 0:
            raise ConfigError(f"chaos node/rank of {self} must be >= 0")
        if self.on_save and (self.kind != "kill" or self.at_seconds is not None):
            raise ConfigError("a save trigger is for kills, optionally after a step")
        if not self.on_save and (self.at_seconds is None) == (self.at_step is None):
            raise ConfigError("a chaos event needs exactly one of at_seconds or at_step")
        if self.at_seconds is not None and self.at_seconds < 0:
            raise ConfigError(f"chaos at_seconds {self.at_seconds} must be >= 0")
        if self.at_step is not None and self.at_step < 1:
            raise ConfigError(f"chaos at_step {self.at_step} must be >= 1 (steps count from 1)")
        if self.after_seconds and (self.at_step is None or self.on_save):
            raise ConfigError("a delay in seconds follows a step trigger (stepN+Xs), not a save")

    def __str__(self) -> str:
        when = f"{self.at_seconds:g}s" if self.at_seconds is not None else f"step{self.at_step}"
        if self.after_seconds:
            when += f"+{self.after_seconds:g}s"
        if self.on_save:
            when = "save" if self.at_step is None else f"step{self.at_step}+save"
        target = self.node if self.node is not None else f"rank{self.rank}"
        return f"{self.kind}:{target}@{when}"

    @property
    def by_step(self) -> bool:
        """Triggered by the training's progress (a step or a save), not by time."""
        return self.at_step is not None or self.on_save

    @property
    def step_order(self) -> int:
        return self.at_step or 0

    def is_due(self, *, elapsed: float, step: int) -> bool:
        """Due by time or step; a save trigger is then armed, see :func:`open_partial_save`."""
        if self.at_seconds is not None:
            return elapsed >= self.at_seconds
        return self.at_step is None or step >= self.at_step


def held_back(event: ChaosEvent, pending: Iterable[ChaosEvent]) -> bool:
    """Whether ``event``, due by its step, waits for a pending event of an earlier step
    (an armed save kill that has not caught a save yet, a rank not resolved yet):
    step-triggered events land in step order, however late one of them is. A
    ``save`` trigger without a step counts as step 0; events due by time never wait."""
    if not event.by_step:
        return False
    return any(e.by_step and e.step_order < event.step_order for e in pending)


def parse_event(token: str) -> ChaosEvent:
    """One ``KIND:NODE@WHEN`` token; the error names the token and the accepted forms."""
    match = _EVENT.match(token.strip())
    if match is None:
        raise ConfigError(f"chaos event {token!r} is malformed; {_FORMS}")
    kind, when = match["kind"], match["when"]
    if kind not in KINDS:
        raise ConfigError(f"chaos event {token!r} has unknown kind {kind!r}; {_FORMS}")
    seconds, step, save = _SECONDS.match(when), _STEP.match(when), _SAVE.match(when)
    if seconds is None and step is None and save is None:
        raise ConfigError(f"chaos event {token!r} has a bad time {when!r}; {_FORMS}")
    target = match["target"]
    if kind == "join" and target.startswith("rank"):
        raise ConfigError(f"chaos event {token!r}: a join needs a node index; {_FORMS}")
    if kind != "kill" and save is not None:
        raise ConfigError(f"chaos event {token!r}: only a kill can wait for a save; {_FORMS}")
    if save is not None:
        step = save if save["value"] is not None else None
    return ChaosEvent(
        kind=kind,  # type: ignore[arg-type]  # checked against KINDS above
        node=None if target.startswith("rank") else int(target),
        rank=int(target.removeprefix("rank")) if target.startswith("rank") else None,
        at_seconds=float(seconds["value"]) if seconds else None,
        at_step=int(step["value"]) if step else None,
        on_save=save is not None,
        after_seconds=float(step["delay"]) if step and save is None and step["delay"] else 0.0,
    )


def parse_schedule(text: str) -> tuple[ChaosEvent, ...]:
    """A whole ``--chaos`` string; an empty string is an empty schedule."""
    if not text.strip():
        return ()
    tokens = text.split(",")
    if any(not token.strip() for token in tokens):
        raise ConfigError(f"chaos schedule {text!r} has an empty event; {_FORMS}")
    return tuple(parse_event(token) for token in tokens)


def validate_schedule(events: Iterable[ChaosEvent], *, nodes: int) -> None:
    """Refuse events aimed at nodes that never exist: not started and never joined."""
    events = tuple(events)
    joined = {event.node for event in events if event.kind == "join"}
    for event in events:
        if event.node is None:
            continue  # a rank target names whichever node runs that rank
        if event.kind != "join" and event.node >= nodes and event.node not in joined:
            raise ConfigError(
                f"chaos event {str(event)!r} targets node {event.node}, but only nodes "
                f"0..{nodes - 1} are started and no join event starts node {event.node}"
            )


def node_count(events: Iterable[ChaosEvent], *, nodes: int) -> int:
    """How many distinct nodes the run can have: the initial ones plus new joiners."""
    return len(node_indexes(events, nodes=nodes))


def node_indexes(events: Iterable[ChaosEvent], *, nodes: int) -> list[int]:
    """The index of every node the run can have, in order: the initial ones, then joiners."""
    joined = {event.node for event in events if event.kind == "join" and event.node is not None}
    return sorted(set(range(nodes)) | joined)


@dataclass(frozen=True)
class Recovery:
    """What one delivered event cost, audited from the workers' records.

    ``seconds`` runs from the event to the first step completed by a training
    attempt that started after it (the recovering attempt). ``lost_steps`` is
    the work redone: the highest step recorded before that attempt started
    minus the step it restored. A rank records a step as its gradient
    all-reduce starts, so the step a failure broke counts as lost. For a
    failure nothing completes in between, so this is the highest step before
    the event; for a join the survivors train on until the new round, and
    steps they finish after a checkpoint are lost.
    """

    kind: ChaosKind
    node: int
    event_time: float
    seconds: float | None
    lost_steps: int | None
    world_size_after: int | None
    restored_step: int | None
    restore_source: str | None

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "node": self.node,
            "event_time": self.event_time,
            "seconds": self.seconds,
            "lost_steps": self.lost_steps,
            "world_size_after": self.world_size_after,
            "restored_step": self.restored_step,
            "restore_source": self.restore_source,
        }


def node_of_rank(log: AuditLog, rank: int) -> int | None:
    """The index of the node that runs global ``rank`` in the newest attempt (the
    attempt of the latest record); None while no worker of it recorded that rank.

    Not simply the latest record of ``rank``: after a resize a node's old rank
    may be newer than the first record of the node that holds it now.
    """
    records = [*log.resumes, *log.steps]
    if not records:
        return None
    newest = max(records, key=lambda r: r.time).attempt
    holders = [r for r in records if r.attempt == newest and r.rank == rank]
    if not holders:
        return None
    name = max(holders, key=lambda r: r.time).node
    index = name.removeprefix("node")
    return int(index) if index.isdigit() else None


def recovery_after(log: AuditLog, *, kind: ChaosKind, node: int, event_time: float) -> Recovery:
    """Audit the recovery from an event delivered at wall time ``event_time``."""
    attempt = next(
        (a for a in log.attempts(started_after=event_time) if a.first_step_time is not None),
        None,
    )
    if attempt is None:
        return Recovery(kind, node, event_time, None, None, None, None, None)
    assert attempt.first_step_time is not None
    lost = None
    if attempt.restored_step is not None:
        before = log.highest_step_before(attempt.start_time) or 0
        lost = max(0, before - attempt.restored_step)
    return Recovery(
        kind=kind,
        node=node,
        event_time=event_time,
        seconds=attempt.first_step_time - event_time,
        lost_steps=lost,
        world_size_after=attempt.world_size,
        restored_step=attempt.restored_step,
        restore_source=attempt.restore_source,
    )


def freeze_if_saving(agent_pid: int, checkpoint_dir: Path, *, watch_s: float = 0.0) -> str | None:
    """Freeze a node whose processes write a checkpoint now; the partial file they write.

    Watches up to ``watch_s`` for a save to begin (a tick of a fixed period could
    keep missing saves of a period that divides it). The process holding a partial
    save's file is stopped first, alone, then the rest of the node. A partial
    directory holds no open file for part of its life (before the state is
    serialized, during the manifest and the fsyncs): freezing the whole node at
    the directory's first sight often landed there, and on a loaded 2-core box
    the kill missed 16 saves in a row. Returns None, with the node untouched,
    when no process was caught holding such a file. A process a ``stop`` event
    froze stays frozen.
    """
    deadline = time.monotonic() + watch_s
    try:
        root = psutil.Process(agent_pid)
        tree = [root, *proctree.descendants(root)]
    except psutil.Error:
        return None
    while True:
        if any(checkpoint_dir.glob(PARTIAL_SAVE_GLOB)):
            partial = _stop_the_writer(tree, checkpoint_dir)
            if partial is not None:
                proctree.freeze_tree(root)  # the rest of the node, for the kill
                return partial
        if time.monotonic() >= deadline:
            return None  # the usual case, without touching the node
        time.sleep(0.005)


def _stop_the_writer(procs: list[psutil.Process], checkpoint_dir: Path) -> str | None:
    """SIGSTOP the process of ``procs`` that holds a partial save's file open; the file,
    checked again once it is stopped. None (and the process continued) when none does
    by then."""
    for proc in procs:
        if open_partial_save([proc], checkpoint_dir) is None:
            continue
        was_stopped = _is_stopped(proc)
        with contextlib.suppress(psutil.Error):
            proc.suspend()
        partial = open_partial_save([proc], checkpoint_dir)
        if partial is not None:
            return partial
        if not was_stopped:
            with contextlib.suppress(psutil.Error):
                proc.resume()
    return None


def open_partial_save(procs: Iterable[psutil.Process], checkpoint_dir: Path) -> str | None:
    """A file inside an unfinished save's directory that one of ``procs`` holds open,
    relative to ``checkpoint_dir``."""
    root = checkpoint_dir.resolve()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            for opened in proc.open_files():
                path = Path(opened.path)
                if path.parent.parent == root and path.parent.match(PARTIAL_SAVE_GLOB):
                    return str(path.relative_to(root))
    return None


def kill_workers_together(agent_pids: Mapping[int, int]) -> dict[int, float]:
    """SIGKILL every process below several nodes' agents, within milliseconds.

    Every tree is frozen first, so no node notices another's loss before its own
    kill. The agents themselves stay frozen, for the runner's usual kill of each
    node (which also reaps, and that takes long). Returns each node's wall time
    of its SIGKILLs.
    """
    frozen: dict[int, list[psutil.Process]] = {}
    for node, pid in agent_pids.items():
        with contextlib.suppress(psutil.Error):
            frozen[node] = proctree.freeze_tree(psutil.Process(pid))
    times = {}
    for node, procs in frozen.items():
        times[node] = time.time()
        proctree.signal_all([p for p in procs if p.pid != agent_pids[node]], signal.SIGKILL)
    return times


def _is_stopped(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.status() == psutil.STATUS_STOPPED
    return False
