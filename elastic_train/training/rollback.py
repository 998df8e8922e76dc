"""An in-process re-form's last collectives: every member back to one state.

After the group is re-formed (:mod:`.inprocess`), each member first rewinds
alone to its last completed step (a failure inside a step: that step's
optimizer update never ran), then the members agree on the newest step among
them and the lowest rank holding it broadcasts that state to the others (a
ring all-reduce can finish on one rank and fail on another, and a joiner
holds nothing yet). No optimizer step is undone.

Those collectives run under the in-process floor timeout
(:meth:`StepTimeout.bounded`), not ``pg_timeout_seconds``: a member whose
peer dies in the middle of them waits in a gloo receive that nothing but the
timeout ends. (Except a joiner's first all-reduce, which waits for the members'
switch.) Seen here: a holder SIGKILLed during an admission's broadcast
left two members waiting the full 60 s, and the joiner among them ended in a
worker restart. A failure here is reported, not raised, so the caller can
re-form without the dead and try again (:func:`.inprocess.regroup`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from elastic_train.log import get_logger
from elastic_train.state.restore import broadcast_state
from elastic_train.training.heal import begin as heal_begin
from elastic_train.training.step_timeout import StepTimeout

if TYPE_CHECKING:
    from elastic_train.training.inprocess import LoopHooks
    from elastic_train.training.loop import Trainer

log = get_logger(__name__)


def rewind(t: Trainer) -> int:
    """Back to the last completed step; the step that was in flight at the failure
    (for lost-step accounting)."""
    start, t.step_start = t.step_start, None
    in_flight = t.step + 1 if start is not None else t.step
    if start is not None:  # failed inside the step: its optimizer step never ran
        t.sampler.load_state_dict(start.sampler)
        torch.set_rng_state(start.torch_rng["torch"])
        if "cuda" in start.torch_rng:
            torch.cuda.set_rng_state_all(start.torch_rng["cuda"])
        t.comm_hook.load_state_dict(start.comm_hook)
        t.step = start.step
    t.optimizer.zero_grad(set_to_none=True)
    return in_flight


def take_newest(
    t: Trainer, hooks: LoopHooks, *, joining: bool, timeout: StepTimeout, heal: bool = False
) -> str | None:  # fmt: skip
    """Every member of the current group to the newest step among them; the
    collective's error when a peer failed meanwhile (None: done).
    ``joining``: this worker holds no state yet (an async join): it receives the newest.
    ``heal``: this rank's vote to bring the joiners their state during the next step
    instead (:mod:`.heal`; taken when every rank votes so and the ranks line up)."""
    own = -1 if joining else t.step
    world, rank = t.ctx.world_size, t.ctx.rank
    held = state = None
    try:
        # A joiner's group is formed before the members switch to it, at their next
        # check step: it waits for them here, a step time or two, under the full limit.
        with contextlib.nullcontext() if joining else timeout.bounded():
            # One all-reduce (max) of: the newest step, the oldest, (own x world + world
            # - 1 - rank) the lowest rank that holds the newest, and for healing: every
            # rank's vote, the highest rank with a state, the lowest without, the
            # oldest step held.
            keys = [own, -own, own * world + world - 1 - rank, -int(heal),
                    rank if own >= 0 else -1, -rank if own < 0 else -world,
                    -own if own >= 0 else -(1 << 62)]  # fmt: skip
            steps = torch.tensor(keys, dtype=torch.int64, device=t.ctx.device)
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        newest, minus_oldest, holder, minus_vote, last_held, minus_first_bare, minus_held = (
            steps.tolist()
        )
        if newest == -minus_oldest:
            return None
        if minus_vote == -1 and newest == -minus_held >= 0 and last_held < -minus_first_bare:
            # Every rank with a state holds the newest and they come first: only
            # joiners are behind, and they can heal during the next step.
            with timeout.bounded():
                heal_begin(t, hooks, members=last_held + 1, step=newest)
            return None
        src = world - 1 - holder % world
        # Every rank at the newest step holds that state already (in lockstep: the
        # same all-reduced gradients): it passes its own and decodes nothing.
        held = hooks.state_dict(t) if own == newest else None
        with timeout.bounded():
            state = broadcast_state(held, src, None, fingerprint="inprocess", step=newest,
                                    map_location=t.ctx.device)  # fmt: skip
    except RuntimeError as exc:  # torch's DistError: a peer died or timed out meanwhile
        return f"{type(exc).__name__}: {exc}"
    if held is None:
        hooks.load_state_dict(t, state)
        if t.inprocess is not None:
            t.inprocess.stateless = False
    log.info("inprocess_newest_broadcast", step=newest, src=src, oldest=-minus_oldest)
    return None
