"""Joins that heal while the members train (#20 item 2; ``elastic.heal_joins``).

At a switch (``training/admission.py``) the joiners hold no state. Without
healing, the members broadcast the whole state to them before the next step,
and everybody waits for it. With healing, the transfer overlaps that step:

1. ``rollback.take_newest``'s one all-reduce also finds that every rank votes
   to heal, that the members hold one step ``s`` and are ranks ``0..n-1``,
   and the joiners ranks ``n..W-1`` (anything else: the broadcast, as before).
2. The members broadcast the small part of the state (everything but the
   model's and the optimizer's tensors: the step, the sampler, the schedule,
   the RNG, the loss scaler, the comm hook) with the size of the rest, so a
   joiner draws step ``s + 1``'s global batch exactly as the members do.
3. Step ``s + 1`` (:func:`data_ranks`): the members split the global batch
   among themselves; a joiner's share is empty, a zero-weight sample
   (``step.step_chunks``), so it adds a zero gradient. Each rank
   backpropagates ``loss sum x W / B`` and DDP averages over ``W``: the
   gradient is the members' sum over B, the same as without the joiners, and
   every sample is used once.
4. Meanwhile the lowest member (the holder) sends the model and the optimizer
   of step ``s`` to each joiner, point to point on the new group. A joiner
   receives them after its backward (:meth:`Transfer.receive`) and applies the
   step's all-reduced gradient to them: state ``s + 1``, as on the members.

Until it has loaded them a joiner is *stateless* (``InProcess.stateless``):
a failure meanwhile brings it the whole state by broadcast (``take_newest``
with ``joining``), and it writes no rescue snapshot (its weights are not a
step's). The holder sends from a packed copy, so its own optimizer step does
not wait; it waits for its sends after the step (:meth:`Transfer.finish`),
when a joiner's death can only cost a re-form of a completed step.

Only where the group is formed in the background (gloo,
``next_group.available``); in-process recovery implies DDP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastic_train.log import get_logger
from elastic_train.state.restore import BROADCAST_PIECE_BYTES, broadcast_state
from elastic_train.state.snapshot_layout import pack, unpack
from elastic_train.training import next_group

if TYPE_CHECKING:
    from elastic_train.training.inprocess import LoopHooks
    from elastic_train.training.loop import Trainer

log = get_logger(__name__)

#: The state's keys that travel point to point during the heal step; the rest is broadcast.
HEAVY = ("model", "optimizer")
_FINGERPRINT = "inprocess-heal"
_SIZE_KEY = "heal_bytes"


def wanted(t: Trainer) -> bool:
    """This rank's vote: healing is on and the group can carry it (in-process
    recovery implies DDP, config/job.py)."""
    return t.cfg.elastic.heal_joins and next_group.available(t.ctx.backend)


@dataclass
class Transfer:
    """One heal step's transfer, as this rank takes part in it."""

    #: Ranks ``0..members-1`` hold the state and split the step's batch.
    members: int
    step: int
    role: str  # "holder", "joiner" or "member"
    nbytes: int
    works: list[Any] = field(default_factory=list)
    buffer: Any = None  # the holder's packed bytes, or the joiner's receive buffer
    started: float = field(default_factory=time.perf_counter)

    def receive(self, t: Trainer) -> None:
        """The joiner, after its backward: wait for the model and the optimizer of
        step :attr:`step` and load them (the all-reduced gradients stay)."""
        if self.role != "joiner":
            return
        ip = t.inprocess
        assert ip is not None  # a heal runs in process only
        waited = time.perf_counter()
        _wait(self.works, ip.timeout.current())
        received = time.perf_counter()
        got, state = unpack(
            self.buffer, fingerprint=_FINGERPRINT, name="the heal from rank 0",
            map_location=t.ctx.device,
        )  # fmt: skip
        if got != self.step:
            raise ValueError(f"heal: rank 0 sent step {got}, expected {self.step}")
        ip.hooks.load_weights(t, state)
        ip.stateless = False
        log.info(
            "inprocess_healed", step=self.step, bytes=self.nbytes,
            overlapped_s=round(waited - self.started, 4),
            waited_s=round(received - waited, 4), load_s=round(time.perf_counter() - received, 4),
        )  # fmt: skip

    def finish(self, t: Trainer) -> None:
        """The holder, after its optimizer step: its sends are complete."""
        if self.role != "holder":
            return
        assert t.inprocess is not None
        _wait(self.works, t.inprocess.timeout.current())
        log.info("inprocess_heal_sent", step=self.step, bytes=self.nbytes,
                 seconds=round(time.perf_counter() - self.started, 4))  # fmt: skip


def settle(t: Trainer) -> None:
    """After the loop: a heal that began at the run's last step boundary has no step
    to ride on. The joiner loads the members' state as it is (no step follows that
    needs a gradient), and rank 0 waits for its sends, before the run's last
    collectives (the evaluation at the end) use the joiner's weights."""
    transfer, t.heal = t.heal, None
    if transfer is not None:
        transfer.receive(t)
        transfer.finish(t)


def data_ranks(t: Trainer) -> int:
    """How many ranks split this step's global batch: the members during a heal step."""
    return t.heal.members if t.heal is not None else t.ctx.world_size


def begin(t: Trainer, hooks: LoopHooks, *, members: int, step: int) -> None:
    """Every rank, after ``take_newest``'s agreement (ranks ``0..members-1`` hold
    step ``step``, the others nothing): broadcast the small part of the state from
    rank 0 and start the point-to-point transfer of the rest (rank 0 to every rank
    from ``members`` on). A collective."""
    rank, world = t.ctx.rank, t.ctx.world_size
    light: dict[str, Any] | None = None
    raw: Any = None
    started = time.perf_counter()
    if rank < members:  # rank 0 packs, the other members pass theirs (nothing decoded)
        state = hooks.state_dict(t)
        light = {k: v for k, v in state.items() if k not in HEAVY}
        if rank == 0:
            raw = pack({k: state[k] for k in HEAVY}, step=step, fingerprint=_FINGERPRINT)
        light[_SIZE_KEY] = len(raw) if raw is not None else 0
    packed = time.perf_counter()
    shipped = broadcast_state(light, 0, None, fingerprint="inprocess", step=step,
                              map_location=t.ctx.device)  # fmt: skip
    broadcast = time.perf_counter()
    nbytes = int(shipped[_SIZE_KEY])
    if rank == 0:
        payload = torch.frombuffer(raw, dtype=torch.uint8)
        works = [dist.isend(piece, dst, tag=i) for dst in range(members, world)
                 for i, piece in enumerate(_pieces(payload))]  # fmt: skip
        t.heal = Transfer(members, step, "holder", nbytes, works, raw)
    elif rank >= members:
        hooks.load_progress(t, shipped)
        assert t.inprocess is not None
        t.inprocess.stateless = True
        raw = bytearray(nbytes)
        payload = torch.frombuffer(raw, dtype=torch.uint8)
        works = [dist.irecv(piece, 0, tag=i) for i, piece in enumerate(_pieces(payload))]
        t.heal = Transfer(members, step, "joiner", nbytes, works, raw)
    else:
        t.heal = Transfer(members, step, "member", nbytes)
    log.info("inprocess_heal_started", step=step, members=members, world_size=world,
             role=t.heal.role, pack_s=round(packed - started, 4),
             light_s=round(broadcast - packed, 4),
             post_s=round(time.perf_counter() - broadcast, 4))  # fmt: skip


def _pieces(payload: torch.Tensor) -> list[torch.Tensor]:
    # Each piece's wait is bounded by the step's timeout: at any sane speed a piece fits.
    return [payload[i : i + BROADCAST_PIECE_BYTES]
            for i in range(0, payload.numel(), BROADCAST_PIECE_BYTES)]  # fmt: skip


def _wait(works: list[Any], timeout_s: float) -> None:
    for work in works:
        work.wait(timedelta(seconds=timeout_s))
