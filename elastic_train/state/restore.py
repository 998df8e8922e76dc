"""Where a restarted group resumes from: one state, the same on every rank.

The candidates are each node's shared-memory snapshot and the disk
checkpoints. Every rank reports, in one ``all_gather``, its node's verified
snapshot step and the newest disk checkpoints whose manifests it can read
(up to ``DISK_STEPS``), and all apply the same deterministic rule
(:func:`decide`), so they reach one decision without a leader, even where
their views differ (a network file system that lags on one node, a read
error on one rank).

The ranks that hold the chosen state then load it, and a second
``all_gather`` tells everyone which of them succeeded. If none did, every
rank refuses that candidate alike and the next newest is chosen; otherwise
the ranks that could not load it (or do not hold it: a new node with an empty
``/dev/shm``, a rank whose listing lags) receive it from the lowest rank that
did. No rank ever trains from a step the others did not restore.

A sharded (FSDP2) checkpoint has no owner: DCP reads every rank's shards
from any rank, so :func:`restore_sharded` picks the newest step that every
rank lists and all ranks load it together (no snapshots, no broadcast).

A state travels in the snapshot slot layout (``snapshot_layout.pack``):
JSON and raw tensor bytes under checksums, verified on arrival. No peer's
bytes are ever unpickled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from elastic_train.errors import CheckpointCorruptError, CheckpointMismatchError
from elastic_train.log import get_logger
from elastic_train.state.sharded import ShardedCheckpointManager
from elastic_train.state.snapshot_layout import pack, unpack

if TYPE_CHECKING:
    from elastic_train.state.checkpoint import CheckpointManager
    from elastic_train.state.snapshot import SnapshotStore

log = get_logger(__name__)

#: How many of its newest loadable disk checkpoints each rank reports.
DISK_STEPS = 8
# What a rank says after trying to load the chosen state.
_NOT_HELD, _FAILED, _LOADED, _MISMATCH = -1, 0, 1, 2


class RestoreDecision(NamedTuple):
    """Where the group resumes from: ``source`` is "snapshot", "disk" or "none"."""

    source: str
    step: int
    owner_rank: int  # a global rank that holds it; -1 for "none"


class Restored(NamedTuple):
    source: str  # "snapshot", "disk" or "none"
    step: int  # 0 for "none"
    state: dict | None


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _holders(table: torch.Tensor, source: str, step: int) -> torch.Tensor:
    """Which rows of the table hold ``(source, step)``."""
    if source == "snapshot":
        return table[:, 0] == step
    return (table[:, 1:] == step).any(dim=1)


def decide(
    table: torch.Tensor, ranks: list[int], *, refused: frozenset[tuple[str, int]] = frozenset()
) -> RestoreDecision:
    """The newest state in a ``[world, 1 + k]`` table, -1 = none: column 0 is each
    rank's snapshot step, the others the disk steps it can read.

    ``refused`` holds candidates that no holder could load. A snapshot wins a
    tie with the disk (it is already in memory); among the ranks holding the
    winner the lowest owns it, so every rank decides the same.
    """
    best: tuple[str, int] | None = None
    for source, columns in (("snapshot", table[:, :1]), ("disk", table[:, 1:])):
        steps = sorted({int(v) for v in columns.flatten().tolist() if v >= 0}, reverse=True)
        step = next((s for s in steps if (source, s) not in refused), None)
        if step is not None and (best is None or step > best[1]):
            best = (source, step)
    if best is None:
        return RestoreDecision("none", 0, -1)
    owner = int(_holders(table, *best).nonzero()[0, 0])
    return RestoreDecision(best[0], best[1], ranks[owner])


def _row(snapshot_step: int | None, disk_steps: list[int]) -> list[int]:
    steps = disk_steps[:DISK_STEPS]
    return [-1 if snapshot_step is None else snapshot_step, *steps] + [-1] * (
        DISK_STEPS - len(steps)
    )


def _gather(
    mine: list[int], group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, list[int], int]:
    """Every rank's row of integers, their global ranks, and this rank's row index."""
    row = torch.tensor(mine, dtype=torch.int64)
    if not (dist.is_available() and dist.is_initialized()):
        return row.unsqueeze(0), [0], 0
    device = _collective_device(group)
    gathered = [torch.empty_like(row, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, row.to(device), group=group)
    ranks = [r if group is None else dist.get_global_rank(group, r) for r in range(len(gathered))]
    return torch.stack(gathered).cpu(), ranks, dist.get_rank(group)


def agree_on_newest(
    *, local_snapshot_step: int | None, disk_step: int | None, group: dist.ProcessGroup | None
) -> RestoreDecision:
    """Agree, in one all_gather, on the newest state anyone holds (no loading, no fallback).

    ``local_snapshot_step`` is this node's verified snapshot (``SnapshotStore.latest_step``),
    ``disk_step`` the newest checkpoint this rank can read. :func:`restore_newest`
    is the whole restore, with the fallback when the winner cannot be loaded.
    """
    table, ranks, _ = _gather(
        _row(local_snapshot_step, [] if disk_step is None else [disk_step]), group
    )
    agreement = decide(table, ranks)
    log.info(
        "restore_agreed",
        source=agreement.source,
        step=agreement.step,
        owner_rank=agreement.owner_rank,
    )
    return agreement


def restore_newest(
    *,
    snapshot: SnapshotStore | None,
    checkpoint: CheckpointManager | ShardedCheckpointManager | None,
    group: dist.ProcessGroup | None,
    map_location: str | torch.device,
) -> Restored:
    """The whole restore, on every rank: the newest state some rank can load.

    Two ``all_gather`` calls when every holder loads the winner; a broadcast
    from the lowest rank that loaded it when some rank lacks it; another
    round per candidate that no holder could load. Raises
    ``CheckpointMismatchError`` on every rank when any rank found the chosen
    checkpoint written under another config.
    """
    if isinstance(checkpoint, ShardedCheckpointManager):
        return restore_sharded(checkpoint, group=group, map_location=map_location)
    snapshot_step = snapshot.latest_step() if snapshot is not None else None
    disk_steps = checkpoint.loadable_steps(limit=DISK_STEPS) if checkpoint is not None else []
    table, ranks, me = _gather(_row(snapshot_step, disk_steps), group)
    fingerprint = next((s.fingerprint for s in (snapshot, checkpoint) if s is not None), "")
    refused: set[tuple[str, int]] = set()
    while True:
        decision = decide(table, ranks, refused=frozenset(refused))
        log.info(
            "restore_agreed", source=decision.source, step=decision.step,
            owner_rank=decision.owner_rank, local_snapshot=snapshot_step, local_disk=disk_steps,
        )  # fmt: skip
        if decision.source == "none":
            return Restored("none", 0, None)
        held = bool(_holders(table, decision.source, decision.step)[me])
        status, state = _load(decision, held, snapshot, checkpoint, map_location)
        statuses = _gather([status], group)[0][:, 0].tolist()
        if _MISMATCH in statuses:
            raise CheckpointMismatchError(
                f"rank {ranks[statuses.index(_MISMATCH)]} found checkpoint step "
                f"{decision.step} written under another config fingerprint (its log names "
                "both): a field that must not change across a resume differs; use a new "
                "checkpoint directory or restore the original config"
            )
        loaded = [ranks[i] for i, s in enumerate(statuses) if s == _LOADED]
        if not loaded:
            failed = [ranks[i] for i, s in enumerate(statuses) if s == _FAILED]
            log.warning(
                "restore_candidate_refused", source=decision.source, step=decision.step,
                failed_ranks=failed, fallback="the next newest state",
            )  # fmt: skip
            refused.add((decision.source, decision.step))
            continue
        if len(loaded) < len(statuses):
            state = broadcast_state(
                state, loaded[0], group, fingerprint=fingerprint, step=decision.step,
                map_location=map_location,
            )  # fmt: skip
        return Restored(decision.source, decision.step, state)


def restore_sharded(
    checkpoint: ShardedCheckpointManager,
    *,
    group: dist.ProcessGroup | None,
    map_location: str | torch.device,
) -> Restored:
    """The newest DCP checkpoint that every rank can read, loaded by all ranks together.

    DCP reads any rank's shards from any rank, so there is no owner and no
    broadcast: a step counts only if every rank lists it. A load fails on
    every rank alike (the checksums and DCP's own errors are agreed on), and
    then the next newest is tried.
    """
    table, _, _ = _gather(_row(None, checkpoint.loadable_steps(limit=DISK_STEPS)), group)
    common = set.intersection(*({int(s) for s in row[1:].tolist() if s >= 0} for row in table))
    for step in sorted(common, reverse=True):
        log.info("restore_agreed", source="disk", step=step, owner_rank=-1, sharded=True)
        try:
            return Restored("disk", step, checkpoint.load(step, map_location=map_location))
        except CheckpointCorruptError as exc:
            log.warning("restore_candidate_refused", source="disk", step=step, error=str(exc),
                        fallback="the next newest state")  # fmt: skip
    log.info("restore_agreed", source="none", step=0, owner_rank=-1, sharded=True)
    return Restored("none", 0, None)


def _load(
    decision: RestoreDecision,
    held: bool,
    snapshot: SnapshotStore | None,
    checkpoint: CheckpointManager | None,
    map_location: str | torch.device,
) -> tuple[int, dict | None]:
    """This rank's status for the chosen state, and the state where it loaded."""
    if not held:
        return _NOT_HELD, None
    if decision.source == "snapshot":
        loaded = snapshot.load(map_location=map_location, step=decision.step)  # type: ignore[union-attr]
        return (_LOADED, loaded[1]) if loaded is not None else (_FAILED, None)
    try:
        return _LOADED, checkpoint.load(decision.step, map_location=map_location)  # type: ignore[union-attr]
    except CheckpointCorruptError as exc:
        log.warning("checkpoint_fallback", step=decision.step, reason=str(exc))
        return _FAILED, None
    except CheckpointMismatchError as exc:
        log.error("checkpoint_mismatch", step=decision.step, error=str(exc))
        return _MISMATCH, None


#: Bytes of one broadcast of a shipped state: 16 MiB is 5 s at 3.4 MB/s.
BROADCAST_PIECE_BYTES = 16 << 20


def broadcast_state(
    state: dict | None,
    src: int,
    group: dist.ProcessGroup | None,
    *,
    fingerprint: str,
    step: int,
    map_location: str | torch.device = "cpu",
) -> dict:
    """Ship ``state`` of ``step`` from global rank ``src`` to every rank of ``group``.

    It travels as the bytes of a snapshot slot (``snapshot_layout.pack``: JSON
    and raw tensor bytes), its size first, then the payload in broadcasts of
    :data:`BROADCAST_PIECE_BYTES`, and arrives verified: header crc32, data
    checksum, ``fingerprint`` and ``step``. Nothing is unpickled. A rank that
    passes a state (``src`` must) gets it back, and the bytes it receives are
    not decoded; the others pass None.
    """
    device = _collective_device(group)
    is_src = dist.get_rank() == src
    if is_src and state is None:
        raise ValueError(f"broadcast_state: the source rank {src} must pass its state")
    raw: Any = pack(state, step=step, fingerprint=fingerprint) if is_src else None
    size = torch.tensor([len(raw) if is_src else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    if not is_src:
        raw = bytearray(int(size.item()))  # the tensor shares it: no copy to bytes after
    payload = torch.frombuffer(raw, dtype=torch.uint8)
    on_device = payload.to(device)
    # In pieces: each broadcast is one collective under the group's timeout, which
    # an in-process re-form shortens to seconds (a rank blocked on a peer that died
    # mid-broadcast wakes only at it), and a piece must fit in that at any sane speed.
    for start in range(0, on_device.numel(), BROADCAST_PIECE_BYTES):
        dist.broadcast(on_device[start : start + BROADCAST_PIECE_BYTES], src, group=group)
    if state is not None:
        return state
    if on_device.device.type != "cpu":
        payload.copy_(on_device)
    received, shipped = unpack(
        raw, fingerprint=fingerprint, name=f"state from rank {src}", map_location=map_location
    )
    if received != step:
        raise ValueError(f"broadcast_state: rank {src} sent step {received}, expected {step}")
    return shipped
