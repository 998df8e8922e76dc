"""Where a node agent setting comes from: its ``--rdzv-conf`` key, else its variable.

Only the standard library: the torchrun plugin reads ``warm_start`` before
the agent imports anything else (:func:`elastic_train.agent.zygote.fork_early`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

__all__ = ["agent_setting"]


def agent_setting(params: RendezvousParameters, key: str, environ: Mapping[str, str]) -> str | None:
    """An rdzv-conf key's value, else its ``ELASTIC_TRAIN_<KEY>`` variable, else None."""
    value = params.config.get(key)
    return str(value) if value is not None else environ.get(f"ELASTIC_TRAIN_{key.upper()}")
