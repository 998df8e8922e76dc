"""A preemption in process: the preempted ranks leave, the others re-form without them.

On the restart path every rank stops after the step the ranks agreed on, and
the ranks that were not signalled exit ``EXIT_PEER_PREEMPTED`` for their
agents to restart them (docs/faults.md). In process (``t.inprocess`` set), one
more all-reduce after that step counts the ranks that stay:

=============  ===========================================================
ranks staying  what each rank does
=============  ===========================================================
none           ``"stop"``: the whole job stops as on the restart path (the
               step is saved to disk)
some           a preempted rank stops answering liveness probes before the
               count and exits without a save: ``"leave"`` (the others hold
               the step in memory); the others re-form the group without it,
               in place, and train on: ``"stay"``
=============  ===========================================================

A rank signalled after the count stays, and leaves at the next check.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from elastic_train.log import get_logger
from elastic_train.training.inprocess import regroup

if TYPE_CHECKING:
    from elastic_train.training.loop import Trainer

log = get_logger(__name__)

Departure = Literal["stop", "leave", "stay"]


def after_preemption(t: Trainer) -> Departure:
    """At a stop the ranks agreed on (a collective on every rank in process)."""
    ip = t.inprocess
    if ip is None:
        return "stop"
    leaving = t.guards.preemption.received is not None
    if leaving:  # before the count: a survivor's probe after it is refused at once
        ip.membership.stop_answering()
    count = torch.tensor([0 if leaving else 1], device=t.ctx.device)
    dist.all_reduce(count)
    staying = int(count.item())
    if staying == 0:
        return "stop"
    if leaving:
        ip.published = -1  # the join marker is the survivors' now: not retired at exit
        log.warning("inprocess_leaving", step=t.step, staying_ranks=staying)
        return "leave"
    _shrink(t)
    return "stay"


def _shrink(t: Trainer) -> None:
    ip = t.inprocess
    assert ip is not None
    began, started = time.time(), time.perf_counter()
    old_world = t.ctx.world_size
    with t.guards.long_operation("inprocess_departure"):
        _, timings = regroup(t, planned=True)
    gen = ip.membership.current
    assert gen is not None
    t.metrics.regrouped(cause="preemption", started_at=began, nodes=gen.nodes)
    log.info(
        "inprocess_shrunk_after_preemption", step=t.step, world_size=t.ctx.world_size,
        old_world_size=old_world, rank=t.ctx.rank, seconds=round(time.perf_counter() - started, 4),
        **timings,
    )  # fmt: skip
