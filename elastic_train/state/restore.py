"""Where a restarted group resumes from: the newest state any rank holds.

The candidates are each node's shared-memory snapshot and the disk checkpoints.
Every rank contributes two integers to one ``all_gather`` and applies the same
deterministic rule, so all ranks reach the same decision without a leader; the
winning state then travels from a rank that holds it to the others (a new node
with an empty ``/dev/shm`` included) as bytes in a tensor broadcast.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from elastic_train.log import get_logger

if TYPE_CHECKING:
    from elastic_train.state.checkpoint import CheckpointManager
    from elastic_train.state.snapshot import SnapshotStore

log = get_logger(__name__)


class RestoreDecision(NamedTuple):
    """Where the group resumes from: ``source`` is "snapshot", "disk" or "none"."""

    source: str
    step: int
    owner_rank: int  # a global rank that holds it; -1 for "none"


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def decide(table: torch.Tensor, ranks: list[int]) -> RestoreDecision:
    """The newest state in a ``[world, 2]`` table of (snapshot step, disk step), -1 = none.

    A snapshot wins a tie with the disk (it is already in memory); among ranks
    holding the winner the lowest rank owns it, so every rank decides the same.
    """
    for column, source in ((0, "snapshot"), (1, "disk")):
        best = int(table[:, column].max())
        if best >= 0 and best >= int(table.max()):
            owner = int((table[:, column] == best).nonzero()[0, 0])
            return RestoreDecision(source, best, ranks[owner])
    return RestoreDecision("none", 0, -1)


def _gather(
    local_snapshot_step: int | None, disk_step: int | None, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, list[int]]:
    """Every rank's (snapshot step, disk step), -1 for none, and their global ranks."""
    mine = torch.tensor(
        [
            -1 if local_snapshot_step is None else local_snapshot_step,
            -1 if disk_step is None else disk_step,
        ],
        dtype=torch.int64,
    )
    if not (dist.is_available() and dist.is_initialized()):
        return mine.unsqueeze(0), [0]
    device = _collective_device(group)
    gathered = [
        torch.empty(2, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))
    ]
    dist.all_gather(gathered, mine.to(device), group=group)
    ranks = [r if group is None else dist.get_global_rank(group, r) for r in range(len(gathered))]
    return torch.stack(gathered).cpu(), ranks


def agree_on_newest(
    *, local_snapshot_step: int | None, disk_step: int | None, group: dist.ProcessGroup | None
) -> RestoreDecision:
    """Agree, in one all_gather of two integers per rank, on the newest state anyone holds.

    ``local_snapshot_step`` is this node's verified snapshot (``SnapshotStore.latest_step``
    or the step of ``load()``), ``disk_step`` the newest checkpoint this rank can read.
    Without an initialized process group it decides from the local values alone.
    """
    agreement = decide(*_gather(local_snapshot_step, disk_step, group))
    log.info(
        "restore_agreed",
        source=agreement.source,
        step=agreement.step,
        owner_rank=agreement.owner_rank,
    )
    return agreement


class Restored(NamedTuple):
    source: str  # "snapshot", "disk" or "none"
    step: int  # 0 for "none"
    state: dict | None


def restore_newest(
    *,
    snapshot: SnapshotStore | None,
    checkpoint: CheckpointManager | None,
    group: dist.ProcessGroup | None,
    map_location: str | torch.device,
) -> Restored:
    """The whole restore, on every rank: the newest state any node or the disk holds.

    Loads this node's snapshot, agrees in one all_gather, and then: a winning
    snapshot is used where it is local and broadcast from its owner only when
    some rank lacks it (a new node, a node with an older copy); a winning disk
    checkpoint is loaded by every rank from the shared ``checkpoint.dir``
    (with the usual fallback past corrupt ones).
    """
    local = snapshot.load(map_location=map_location) if snapshot is not None else None
    disk_step = checkpoint.latest_step() if checkpoint is not None else None
    table, ranks = _gather(local[0] if local else None, disk_step, group)
    agreement = decide(table, ranks)
    log.info(
        "restore_agreed",
        source=agreement.source,
        step=agreement.step,
        owner_rank=agreement.owner_rank,
        local_snapshot=local[0] if local else None,
    )
    if agreement.source == "snapshot":
        mine = local[1] if local is not None and local[0] == agreement.step else None
        if not bool((table[:, 0] == agreement.step).all()):
            mine = broadcast_state(mine, agreement.owner_rank, group, map_location=map_location)
        return Restored("snapshot", agreement.step, mine)
    if agreement.source == "disk":
        if checkpoint is None:
            raise ValueError(
                "restore_newest: the group chose a disk checkpoint, "
                "but this rank was given no CheckpointManager"
            )
        loaded = checkpoint.load_latest(map_location=map_location)
        if loaded is not None:
            return Restored("disk", loaded[0], loaded[1])
    return Restored("none", 0, None)


def broadcast_state(
    state: dict | None,
    src: int,
    group: dist.ProcessGroup | None,
    *,
    map_location: str | torch.device = "cpu",
) -> dict:
    """Ship ``state`` from global rank ``src`` to every rank of ``group``.

    The state travels as ``torch.save`` bytes in a uint8 tensor (two broadcasts:
    size, then payload) and is read back with ``weights_only=True``, so no
    peer can make us unpickle an arbitrary object. ``src`` gets its own
    ``state`` back; the others pass anything (ignored).
    """
    device = _collective_device(group)
    is_src = dist.get_rank() == src
    if is_src and state is None:
        raise ValueError(f"broadcast_state: the source rank {src} must pass its state")
    if is_src:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    if not is_src:
        # The receive buffer is a bytearray the tensor shares, so the bytes need
        # no conversion afterwards (bytes(storage) iterates element by element:
        # seconds for a few MB).
        received = bytearray(int(size.item()))
        payload = torch.frombuffer(received, dtype=torch.uint8)
    on_device = payload.to(device)
    dist.broadcast(on_device, src, group=group)
    if is_src:
        return state
    if on_device.device.type != "cpu":
        payload.copy_(on_device)
    return torch.load(io.BytesIO(received), map_location=map_location, weights_only=True)
