"""The per-step audit record that workers append and the local runner reads.

The format is the contract in docs/DESIGN.md ("Audit protocol"). The runner
checks exactly-once delivery from these records, independently of the
sampler's own arithmetic.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    import torch

RESULT_FILE = "result.json"
FINAL_PARAMS_FILE = "final_params.pt"


class AuditWriter:
    """Appends this worker's ``resume`` and ``step`` records to its own JSONL file."""

    def __init__(
        self, directory: str | Path, *, attempt: str, rank: int, world_size: int, node: str
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"worker-{node}-{os.getpid()}.jsonl"
        self._common = {"attempt": attempt, "rank": rank, "world_size": world_size, "node": node}
        # O_APPEND and one write() per record: a killed worker leaves whole
        # lines (at worst a torn last one), never interleaved ones.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def _append(self, record: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def resume(self, *, restored_step: int, source: str) -> None:
        self._append(
            {"kind": "resume", "restored_step": restored_step, "source": source,
             **self._common, "time": time.time()}
        )  # fmt: skip

    def step(self, *, step: int, epoch: int, indices: Sequence[int], loss: float) -> None:
        self._append(
            {"kind": "step", "step": step, "epoch": epoch, **self._common,
             "indices": list(indices), "loss": loss, "time": time.time()}
        )  # fmt: skip

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def write_result(
    directory: str | Path, *, result: Mapping[str, Any], params: Mapping[str, torch.Tensor]
) -> None:
    """Rank 0 at the end: ``result.json`` and ``final_params.pt``, each replaced atomically."""
    import torch  # here: the runner reads audits, and a torch import costs it 2 s

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{FINAL_PARAMS_FILE}.tmp"
    torch.save({k: v.detach().cpu() for k, v in params.items()}, tmp)
    os.replace(tmp, directory / FINAL_PARAMS_FILE)
    tmp = directory / f".{RESULT_FILE}.tmp"
    tmp.write_text(json.dumps(dict(result), indent=2) + "\n")
    os.replace(tmp, directory / RESULT_FILE)


# ---------------------------------------------------------------------------
# Reader: the runner's side of the audit protocol (see docs/DESIGN.md).
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """One rank's record of one optimizer step."""

    attempt: str
    step: int
    epoch: int
    rank: int
    world_size: int
    node: str
    indices: tuple[int, ...]
    loss: float
    time: float


@dataclass(frozen=True)
class ResumeRecord:
    """One rank's record of a (re)start, written after its state was restored."""

    attempt: str
    restored_step: int
    source: str
    world_size: int
    rank: int
    node: str
    time: float
    dataset_len: int | None = None


AuditRecord = StepRecord | ResumeRecord


def parse_record(line: str) -> AuditRecord | None:
    """One JSON line; ``None`` for record kinds this reader does not know."""
    raw = json.loads(line)
    kind = raw.get("kind")
    if kind == "step":
        return StepRecord(
            attempt=str(raw["attempt"]),
            step=int(raw["step"]),
            epoch=int(raw["epoch"]),
            rank=int(raw["rank"]),
            world_size=int(raw["world_size"]),
            node=str(raw["node"]),
            indices=tuple(int(i) for i in raw["indices"]),
            loss=float(raw["loss"]),
            time=float(raw["time"]),
        )
    if kind == "resume":
        dataset_len = raw.get("dataset_len")
        return ResumeRecord(
            attempt=str(raw["attempt"]),
            restored_step=int(raw["restored_step"]),
            source=str(raw["source"]),
            world_size=int(raw["world_size"]),
            rank=int(raw["rank"]),
            node=str(raw["node"]),
            time=float(raw["time"]),
            dataset_len=None if dataset_len is None else int(dataset_len),
        )
    return None


@dataclass(frozen=True)
class Attempt:
    """One start of the worker group: every rank shares the attempt id of rank 0."""

    id: str
    start_time: float
    world_size: int
    restored_step: int | None
    restore_source: str | None
    #: step -> the records of that step, one per rank
    steps: dict[int, list[StepRecord]]

    @property
    def first_step_time(self) -> float | None:
        """When the attempt's first step was complete: the last rank's record of it."""
        if not self.steps:
            return None
        return max(record.time for record in self.steps[min(self.steps)])

    @property
    def last_step(self) -> int | None:
        return max(self.steps, default=None)


@dataclass
class _AttemptRecords:
    """One attempt's records, indexed as they arrive: a question about the attempts
    since an event then costs the number of attempts, not of records (a soak of
    1000 kills holds hundreds of thousands of records, and is asked every poll)."""

    resumes: list[ResumeRecord] = field(default_factory=list)
    steps: dict[int, list[StepRecord]] = field(default_factory=dict)
    first_step_time: float = math.inf
    last_step_time: float = -math.inf
    highest_step: int = -1

    def add(self, record: AuditRecord) -> None:
        if isinstance(record, ResumeRecord):
            self.resumes.append(record)
            return
        self.steps.setdefault(record.step, []).append(record)
        self.first_step_time = min(self.first_step_time, record.time)
        self.last_step_time = max(self.last_step_time, record.time)
        self.highest_step = max(self.highest_step, record.step)

    @property
    def start_time(self) -> float:
        if self.resumes:
            return min(r.time for r in self.resumes)
        return self.first_step_time

    def highest_step_before(self, moment: float) -> int | None:
        if self.first_step_time >= moment:
            return None
        if self.last_step_time < moment:
            return self.highest_step
        return max(s for s, rs in self.steps.items() if any(r.time < moment for r in rs))

    def snapshot(self, attempt_id: str) -> Attempt:
        first = min(self.resumes, key=lambda r: r.time) if self.resumes else None
        any_step = next(iter(self.steps.values()))[0] if self.steps else None
        return Attempt(
            id=attempt_id,
            start_time=self.start_time,
            world_size=first.world_size if first else any_step.world_size,  # type: ignore[union-attr]
            restored_step=first.restored_step if first else None,
            restore_source=first.source if first else None,
            steps={step: list(records) for step, records in self.steps.items()},
        )


@dataclass
class AuditLog:
    """Every record read so far from an audit directory."""

    steps: list[StepRecord] = field(default_factory=list)
    resumes: list[ResumeRecord] = field(default_factory=list)
    #: complete lines that were not valid records (a torn last line is not counted)
    malformed: int = 0
    _by_attempt: dict[str, _AttemptRecords] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, directory: str | Path) -> AuditLog:
        tail = AuditTail(directory)
        tail.poll()
        return tail.log

    def add(self, record: AuditRecord) -> None:
        if isinstance(record, StepRecord):
            self.steps.append(record)
        else:
            self.resumes.append(record)
        self._by_attempt.setdefault(record.attempt, _AttemptRecords()).add(record)

    def dataset_len(self) -> int | None:
        return next((r.dataset_len for r in self.resumes if r.dataset_len is not None), None)

    def attempts(self, *, started_after: float = -math.inf) -> list[Attempt]:
        """Every attempt with any record (that started after ``started_after``), in the
        order they started."""
        found = [
            records.snapshot(attempt_id)
            for attempt_id, records in self._by_attempt.items()
            if records.start_time > started_after
        ]
        return sorted(found, key=lambda a: a.start_time)

    def highest_step_before(self, moment: float) -> int | None:
        """The highest step any rank recorded before wall time ``moment``."""
        tops = (records.highest_step_before(moment) for records in self._by_attempt.values())
        return max((top for top in tops if top is not None), default=None)


#: How often a poll lists the directory and looks at every file, and how long a
#: file that stopped growing is still read at every poll when its writer's PID
#: is not visible here (another PID namespace).
RELIST_S = 1.0
QUIET_S = 5.0
AUDIT_GLOB = "worker-*.jsonl"


class AuditTail:
    """Reads an audit directory incrementally: only complete new lines, each once.

    A worker killed mid-write leaves a torn last line without a newline; it is
    never parsed, and nobody appends to that file again (files are per PID).
    A poll reads the files of workers alive at the last listing and those that
    grew lately; it lists the directory, and reads every file that grew, when
    the directory changed (a new worker) and once every ``RELIST_S``. A soak's
    directory holds thousands of dead workers' files, and opening each one
    every 20 ms took most of a core by the 760th kill.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.log = AuditLog()
        self._offsets: dict[Path, int] = {}
        #: file -> monotonic time its offset last moved
        self._grew: dict[Path, float] = {}
        #: the files whose writer was alive at the last listing
        self._live: set[Path] = set()
        self._listed: tuple[int, float] | None = None  # (directory mtime, when)

    def poll(self, *, everything: bool = False) -> list[AuditRecord]:
        """The records appended since the last poll; ``everything`` reads every file."""
        now = time.monotonic()
        new: list[AuditRecord] = []
        for path in self._due(now, everything=everything):
            before = self._offsets.get(path, 0)
            new.extend(self._read_new(path))
            if self._offsets.get(path, 0) != before:
                self._grew[path] = now
        for record in new:
            self.log.add(record)
        return new

    def _due(self, now: float, *, everything: bool) -> list[Path]:
        try:
            mtime = self.directory.stat().st_mtime_ns
        except FileNotFoundError:
            return []
        listed = self._listed
        if everything or listed is None or listed[0] != mtime or now - listed[1] >= RELIST_S:
            self._listed = (mtime, now)
            return self._relist()
        recent = (path for path, moved in self._grew.items() if now - moved < QUIET_S)
        return sorted(self._live.union(recent))

    def _relist(self) -> list[Path]:
        """Every file that grew since it was last read (a stat costs less than an open
        and a read); the live set is renewed on the way."""
        grown, self._live = [], set()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if not fnmatch.fnmatchcase(entry.name, AUDIT_GLOB):
                    continue
                path = Path(entry.path)
                if _writer_alive(entry.name):
                    self._live.add(path)
                if entry.stat().st_size > self._offsets.get(path, 0):
                    grown.append(path)
        return sorted(grown)

    def _read_new(self, path: Path) -> list[AuditRecord]:
        records = []
        for line in read_new_lines(path, self._offsets):
            if not line.strip():
                continue
            try:
                record = parse_record(line)
            except (ValueError, KeyError, TypeError):
                self.log.malformed += 1
                continue
            if record is not None:
                records.append(record)
        return records


def read_new_lines(path: Path, offsets: dict[Path, int]) -> list[str]:
    """The complete lines appended to ``path`` since the offset kept in ``offsets``.

    A torn last line (its writer is mid-append, or was killed) stays unread
    until its newline arrives.
    """
    offset = offsets.get(path, 0)
    with open(path, "rb") as handle:
        handle.seek(offset)
        chunk = handle.read()
    complete = chunk.rfind(b"\n") + 1
    offsets[path] = offset + complete
    return chunk[:complete].decode(errors="replace").splitlines()


def _writer_alive(name: str) -> bool:
    """Whether the PID in ``worker-<node>-<pid>.jsonl`` is a process here (a reused PID
    only costs reads; an unreadable name counts as alive)."""
    pid = name.removesuffix(".jsonl").rsplit("-", 1)[-1]
    return not pid.isdigit() or psutil.pid_exists(int(pid))


def read_result(directory: str | Path) -> dict[str, Any] | None:
    """Rank 0's ``result.json``, or ``None`` when the run did not finish."""
    path = Path(directory) / RESULT_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class ExactlyOnce:
    """The verdict of the exactly-once audit; ``detail`` says why when it fails."""

    ok: bool
    detail: str
    committed_steps: int = 0
    finished_epochs: int = 0

    def to_json(self) -> dict[str, object]:
        return asdict(self)


class _AuditFailure(Exception):
    pass


def committed_steps(log: AuditLog) -> dict[int, list[StepRecord]]:
    """The records that produced the final state, step by step.

    The last attempt with steps made steps ``(restored, last]``; the state it
    restored was made by the latest earlier attempt that recorded that step,
    and so on back to step 0. Steps that a later restore threw away are thus
    never counted, whichever attempt recorded them last.
    """
    attempts = [a for a in log.attempts() if a.steps]
    if not attempts:
        raise _AuditFailure("no step records")
    committed: dict[int, list[StepRecord]] = {}
    current, upper = attempts[-1], attempts[-1].last_step
    while True:
        if current.restored_step is None:
            raise _AuditFailure(f"attempt {current.id} has no resume record")
        assert upper is not None
        for step in range(current.restored_step + 1, upper + 1):
            if step not in current.steps:
                raise _AuditFailure(f"attempt {current.id} has no record of step {step}")
            committed[step] = current.steps[step]
        if current.restored_step == 0:
            return committed
        upper = current.restored_step
        earlier = [a for a in attempts if a.start_time < current.start_time and upper in a.steps]
        if not earlier:
            raise _AuditFailure(f"no attempt recorded step {upper}, which {current.id} restored")
        current = earlier[-1]


def audit_exactly_once(log: AuditLog, *, dataset_len: int) -> ExactlyOnce:
    """Every finished epoch consumed each sample once; the unfinished one, at most once."""
    if log.malformed:
        return ExactlyOnce(False, f"{log.malformed} malformed audit lines")
    try:
        committed = committed_steps(log)
        epochs = _epoch_indices(committed)
    except _AuditFailure as exc:
        return ExactlyOnce(False, str(exc))
    finished = 0
    expected = list(range(dataset_len))
    for epoch, indices in sorted(epochs.items()):
        counts = Counter(indices)
        duplicated = sorted(i for i, n in counts.items() if n > 1)
        if duplicated:
            return ExactlyOnce(False, f"epoch {epoch}: samples consumed twice: {duplicated[:10]}")
        outside = sorted(i for i in counts if not 0 <= i < dataset_len)
        if outside:
            return ExactlyOnce(False, f"epoch {epoch}: indices outside the dataset: {outside[:10]}")
        if epoch < max(epochs) or len(indices) == dataset_len:
            missing = sorted(set(expected) - counts.keys())
            if missing:
                return ExactlyOnce(False, f"epoch {epoch}: samples never consumed: {missing[:10]}")
            finished += 1
    detail = f"{len(committed)} committed steps, {finished} finished epochs, each sample once"
    return ExactlyOnce(True, detail, committed_steps=len(committed), finished_epochs=finished)


def _epoch_indices(committed: dict[int, list[StepRecord]]) -> dict[int, list[int]]:
    epochs: dict[int, list[int]] = defaultdict(list)
    for step in range(1, max(committed) + 1):
        records = committed.get(step)
        if records is None:
            raise _AuditFailure(f"step {step} has no committed record")
        world_size = records[0].world_size
        ranks = sorted(r.rank for r in records)
        if ranks != list(range(world_size)):
            raise _AuditFailure(
                f"step {step} of attempt {records[0].attempt}: records of ranks {ranks}, "
                f"expected one per rank of world size {world_size}"
            )
        for record in records:
            epochs[record.epoch].extend(record.indices)
    return epochs
