"""The composition root: what torchrun's ``torchrun.handlers`` entry points name.

torchrun asks for a handler creator per backend name (``etcd-v3``, and
``etcd``, which we take over). :func:`create_handler` builds the pieces and
joins them; nothing below this module knows the others:

- the rendezvous handler from :mod:`elastic_train.rendezvous` (on
  :mod:`elastic_train.etcd`), told which extra rdzv-conf keys to accept;
- the node agent from :mod:`elastic_train.agent`, which parses its own keys
  and wraps the handler.

It also tells the workers how to reach the job's etcd and, at every round,
where that round's store is (:func:`inprocess_etcd_env`, :func:`export_rounds`:
``elastic.recovery = "inprocess"``), lets each round settle until the workers
formed their group (:func:`settle_rounds`), and gives a node entering a job whose
in-process group runs a side round of its own
(:mod:`elastic_train.rendezvous.side_round`).

Heavy imports happen inside the functions: torch loads these entry points
while its rendezvous package is still importing, so this module must load
without importing torch's rendezvous modules or ours.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousParameters,
    )

    from elastic_train.agent.node_agent import AgentSettings
    from elastic_train.agent.zygote import ZygoteProcess
    from elastic_train.rendezvous.backend import EtcdV3RendezvousHandler
    from elastic_train.rendezvous.config import RendezvousConfig

__all__ = [
    "NO_TAKEOVER_ENV",
    "check_rdzv_conf",
    "create_handler",
    "etcd_takeover_entry_point",
    "etcd_v3_handler_entry_point",
    "export_rounds",
    "inprocess_etcd_env",
    "settle_rounds",
]

NO_TAKEOVER_ENV = "ELASTIC_TRAIN_NO_ETCD_TAKEOVER"
#: training/etcd_access.py's ETCD_ENV: how workers reach etcd for in-process recovery.
INPROCESS_ETCD_ENV = "ELASTIC_TRAIN_INPROCESS_ETCD"
#: training/exit_barrier.py's EXIT_BARRIER_ENV: where the round the agent joined keeps its store.
EXIT_BARRIER_ENV = "ELASTIC_TRAIN_EXIT_BARRIER"

HandlerCreator = Callable[["RendezvousParameters"], "RendezvousHandler"]


def check_rdzv_conf(params: RendezvousParameters) -> tuple[RendezvousConfig, AgentSettings]:
    """Validate every ``--rdzv-conf`` key, the rendezvous' and the node agent's.

    A bad key or value raises ``ValueError`` (the rendezvous') or
    :class:`~elastic_train.errors.ConfigError` (the agent's), naming it and
    what is accepted.
    """
    from elastic_train.agent.node_agent import RDZV_CONF_KEYS, AgentSettings
    from elastic_train.rendezvous.config import parse_config

    return parse_config(params, extra_keys=RDZV_CONF_KEYS), AgentSettings.from_params(params)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler creator for ``etcd-v3`` and ``etcd``: the etcd v3 handler inside a node agent.

    Every key is checked before anything starts. The rdzv-conf keys are
    listed in :func:`elastic_train.rendezvous.backend.create_handler` and
    :mod:`elastic_train.agent.node_agent`.
    """
    from elastic_train.agent.settings import agent_setting
    from elastic_train.agent.zygote import fork_early

    # First: torchrun has imported torch, and nothing here has made a thread, an
    # etcd channel or a metric yet, so the zygote imports only the rest (~2 s sooner).
    zygote = fork_early(agent_setting(params, "warm_start", os.environ), sys.argv)
    try:
        agent = _start_agent(params, zygote)
    except BaseException:
        if zygote is not None:
            zygote.close(timeout=0)  # it may still import: no reason to wait for it
        raise
    return agent


def _start_agent(params: RendezvousParameters, zygote: ZygoteProcess | None) -> RendezvousHandler:
    from elastic_train.agent.node_agent import RDZV_CONF_KEYS, AgentSettings, NodeAgent
    from elastic_train.log import get_logger
    from elastic_train.rendezvous import backend, side_round

    settings = AgentSettings.from_params(params)
    handler = backend.create_handler(params, extra_keys=RDZV_CONF_KEYS)
    os.environ[INPROCESS_ETCD_ENV] = inprocess_etcd_env(params)
    agent = NodeAgent(settings, run_id=params.run_id, argv=sys.argv, zygote=zygote)
    agent.start(min_nodes=params.min_nodes, max_nodes=params.max_nodes)
    export_rounds(handler, params)
    settle_rounds(handler, agent.group_formed_file)
    # Outermost: a side round is no round of the rendezvous, so it exports none.
    side_round.attach_side_rounds(handler, max_nodes=params.max_nodes)
    if params.backend == "etcd":
        get_logger(__name__).info(
            "etcd_backend_takeover",
            message="rendezvous backend 'etcd' is served by elastic_train's etcd v3 backend "
            f"(set {NO_TAKEOVER_ENV}=1 for torch's v2-API backend)",
        )
    return agent.attach(handler)


def inprocess_etcd_env(params: RendezvousParameters) -> str:
    """The workers' way to the rendezvous etcd, for ``elastic.recovery = "inprocess"``
    (read by ``training/etcd_access.py``'s ``EtcdAccess``): endpoints, TLS file
    paths, user name, key prefix, the secret FILE path. Never a secret or a
    password: those stay in ``secret_file``, ``ELASTIC_TRAIN_RDZV_SECRET`` and
    ``ETCD_PASSWORD``, which the workers inherit.
    """
    from elastic_train.agent.node_agent import RDZV_CONF_KEYS
    from elastic_train.rendezvous.config import parse_config

    config = parse_config(params, extra_keys=RDZV_CONF_KEYS)
    client = config.client
    return json.dumps({
        "endpoints": list(client.endpoints), "prefix": f"{config.key_prefix}/{params.run_id}",
        "protocol": client.protocol, "cacert": client.cacert, "cert": client.cert,
        "key": client.key, "username": client.username,
        "secret_file": params.get("secret_file"), "insecure": config.insecure,
        "min_nodes": params.min_nodes, "max_nodes": params.max_nodes,
    })  # fmt: skip


def export_rounds(handler: EtcdV3RendezvousHandler, params: RendezvousParameters) -> None:
    """Put :data:`EXIT_BARRIER_ENV` into the agent's environment at every round
    ``handler`` joins, for the workers spawned next (read by ``training/exit_barrier.py``):
    the round's store prefixes, its number of agents, the keys' lease ``ttl``. With it the
    final rank 0 arrives at torchrun's exit barrier for nodes that in-process recovery
    removed without a new round. Never a secret: that stays where the rendezvous reads it.
    """
    from elastic_train.agent.node_agent import RDZV_CONF_KEYS
    from elastic_train.rendezvous.config import parse_config

    config = parse_config(params, extra_keys=RDZV_CONF_KEYS)
    join = handler.next_rendezvous

    def next_rendezvous() -> RendezvousInfo:
        info = join()
        os.environ[EXIT_BARRIER_ENV] = json.dumps({
            "store": f"{config.key_prefix}/{params.run_id}/store",  # backend.create_backend's
            # the PrefixStore torch's DynamicRendezvousHandler._wrap_store puts the round in
            "round": f"torch.rendezvous.{handler.settings.run_id}.{handler.joined_round}",
            "agents": info.world_size, "ttl": config.ttl,
        })  # fmt: skip
        return info

    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]


def settle_rounds(handler: EtcdV3RendezvousHandler, formed_file: Callable[[int], Path]) -> None:
    """Let each round ``handler`` joins settle until the workers formed their group
    (``rendezvous/settling.py``): at every round, the workers spawned next get
    ``formed_file(round)`` in :data:`GROUP_FORMED_FILE_ENV` (``agent/verdict.py``) and
    create it then; the round settles until the file exists."""
    from elastic_train.agent.verdict import GROUP_FORMED_FILE_ENV

    handler.settle_until(lambda round_: formed_file(round_).exists())
    join = handler.next_rendezvous

    def next_rendezvous() -> RendezvousInfo:
        info = join()
        assert handler.joined_round is not None
        os.environ[GROUP_FORMED_FILE_ENV] = str(formed_file(handler.joined_round))
        return info

    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]


def etcd_v3_handler_entry_point() -> HandlerCreator:
    """``torchrun.handlers`` entry point ``etcd-v3``."""
    return create_handler


def etcd_takeover_entry_point() -> HandlerCreator:
    """``torchrun.handlers`` entry point ``etcd``: serve torchrun's default backend name.

    torch registers its v2-API ``etcd`` creator first and refuses a different
    creator under that name, so this replaces the registry entry itself and
    returns the same creator (torchrun's ``register`` call is then a no-op).
    ``ELASTIC_TRAIN_NO_ETCD_TAKEOVER=1`` keeps torch's backend.
    ``tests/test_rendezvous_backend.py`` fails if a torch upgrade breaks this.
    """
    # Loaded while torch's rendezvous package imports; its api module is already there.
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    registry: dict[str, HandlerCreator] = rendezvous_handler_registry._registry
    if os.environ.get(NO_TAKEOVER_ENV) == "1":
        return registry["etcd"]
    registry["etcd"] = create_handler
    return create_handler
