"""The etcd v3 rendezvous for torchrun: ``--rdzv-backend etcd-v3`` (and ``etcd``).

PyTorch's ``DynamicRendezvousHandler`` runs the rendezvous state machine; this
module gives it a backend on the etcd v3 API
(:class:`~elastic_train.rendezvous.keys.EtcdV3RendezvousBackend`), an etcd-backed
c10d store, fast-recovery defaults, and the torchrun entry points.

The handler stores its state as a *pickle*, so whoever can write the state key
could run code on every agent that reads it. Every value (state, heartbeats and
the Store's) is therefore signed with the job secret (rdzv-conf ``secret_file``
or ``ELASTIC_TRAIN_RDZV_SECRET``) and checked before its bytes go anywhere
(:mod:`elastic_train.etcd.codec`); running unsigned takes ``insecure=true``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import Store
from torch.distributed.elastic.events import NodeState
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
    _NodeDesc,
    _RendezvousState,
)

from elastic_train.errors import EtcdError, EtcdUnavailableError
from elastic_train.etcd.client import EtcdClient
from elastic_train.etcd.group_marker import ActiveGroup, alive_group
from elastic_train.etcd.store import EtcdV3Store
from elastic_train.log import configure_logging_if_unconfigured, get_logger, register_secret
from elastic_train.rendezvous.config import RendezvousConfig, parse_config, value_codec
from elastic_train.rendezvous.events import record_event
from elastic_train.rendezvous.joins import BatchFold, JoinFolder, JoinKeys, JoinRequester
from elastic_train.rendezvous.keys import EtcdV3RendezvousBackend
from elastic_train.rendezvous.liveness import node_name
from elastic_train.rendezvous.rules import (
    FastOpExecutor,
    WatchedStateHolder,
    keep_alive_while_awaited,
    round_ended,
)
from elastic_train.rendezvous.settling import Settling

__all__ = [
    "EtcdV3RendezvousHandler",
    "create_backend",
    "create_handler",
]

log = get_logger(__name__)

_SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3RendezvousBackend, EtcdV3Store]:
    """``(backend, store)`` for ``params``, like torch's ``etcd_rendezvous_backend.create_backend``.

    Keys: ``{key_prefix}/{run_id}/state``, heartbeats under ``{key_prefix}/{run_id}/heartbeats/``
    and the store under ``{key_prefix}/{run_id}/store/``.
    See :func:`create_handler` for every rdzv-conf key.
    """
    return _create_backend(params, parse_config(params))


def _create_backend(
    params: RendezvousParameters, config: RendezvousConfig
) -> tuple[EtcdV3RendezvousBackend, EtcdV3Store]:
    if not params.run_id:
        raise ValueError("run_id is empty; pass --rdzv-id")
    codec = value_codec(config)  # no secret and no insecure=true: a ValueError
    client = EtcdClient(config.client)
    run_prefix = f"{config.key_prefix}/{params.run_id}"
    backend = EtcdV3RendezvousBackend(
        client,
        name=params.backend,
        key=f"{run_prefix}/state",
        heartbeats=f"{run_prefix}/heartbeats/",
        joins=f"{run_prefix}/joins/",
        leader=f"{run_prefix}/leader",
        beats_digest=f"{run_prefix}/heartbeat_digest",
        ttl=config.ttl,
        codec=codec,
        run_prefix=run_prefix,
    )
    store = EtcdV3Store(client, f"{run_prefix}/store", codec=codec, lease_ttl=config.ttl)
    return backend, store


class EtcdV3RendezvousHandler(DynamicRendezvousHandler):
    """torch's handler with the rules of :mod:`~elastic_train.rendezvous.rules`, made to ride
    out etcd outages.

    - A participant leaving a completed round ends it, so survivors of a failure
      re-form at once; :meth:`num_nodes_waiting` reports the end of this node's
      round, so that an agent whose workers still run restarts them too.
    - Heartbeats while training runs only when a node waits, or while a round
      settles (:meth:`settle_until`): an idle agent sends etcd nothing (see
      ``elastic_train.rendezvous.rules``, rule 2).
    - A rendezvous retries connection failures until ``join_timeout``; an etcd
      outage while training runs is logged and otherwise ignored, because the
      agent polls :meth:`num_nodes_waiting` and would stop the job on an error.
    """

    def __init__(
        self,
        node: _NodeDesc,
        settings: RendezvousSettings,
        store: Store,
        *,
        backend: EtcdV3RendezvousBackend,
        batched_joins: bool = True,
    ) -> None:
        state_holder = WatchedStateHolder(backend, settings, heartbeats=backend)
        super().__init__(node, settings, backend.name, store, state_holder)
        # A silent folder loses the leader key after the time a silent node is pruned in.
        expiry = settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt
        keys = backend.join_keys(lease_ttl=max(2, math.ceil(expiry))) if batched_joins else None
        self._requester = None if keys is None else JoinRequester(keys, node, store=backend)
        self._folder: JoinFolder | None = None
        executor = FastOpExecutor(
            node,
            state_holder,
            settings,
            changes=backend,
            joins=self._requester,
            offer_to_lead=self._offer_to_lead,
        )
        self._op_executor = executor
        self._fold: tuple[JoinKeys, BatchFold] | None = None
        if keys is not None:
            fold = BatchFold(
                keys, backend, settings, prune=state_holder.prune, apply=executor.apply_for
            )
            self._fold = (keys, fold)
        self._etcd_backend = backend
        self._watched_holder = state_holder
        self._joined_round: int | None = None
        self._reported_end: int | None = None
        self._settling: Settling | None = None

    def _record(
        self, message: str, node_state: NodeState = NodeState.RUNNING, rank: int | None = None
    ) -> None:
        record_event(
            self,
            run_id=self._settings.run_id,
            message=message,
            node_state=node_state,
            node=self._this_node,
            rank=rank,
        )

    def next_rendezvous(self) -> RendezvousInfo:
        self._joined_round = None
        self._op_executor.exit_done = False  # a retry below keeps the node's place
        join_s = self.settings.timeout.join.total_seconds()
        deadline = time.monotonic() + join_s
        while True:
            try:
                self._start_folding()
                info = super().next_rendezvous()
                self._joined_round = self._state_holder.state.round
                return info
            except (RendezvousConnectionError, EtcdUnavailableError) as exc:
                if not _is_outage(exc):
                    raise  # bad credentials or permissions: retrying cannot help
                if time.monotonic() >= deadline:
                    raise RendezvousConnectionError(
                        f"rendezvous '{self.settings.run_id}' failed: etcd unreachable for "
                        f"join_timeout={join_s:g}s: {exc}"
                    ) from exc
                log.warning("rendezvous_etcd_retry", run_id=self.settings.run_id, error=str(exc))
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            finally:
                self._stop_folding()

    def _start_folding(self) -> None:
        """Join through a request key, and fold the others' while elected (batched joins)."""
        if self._fold is not None:
            keys, fold = self._fold
            self._folder = JoinFolder(
                keys,
                self._this_node,
                fold_batch=fold,
                wake_every=self._settings.keep_alive_interval.total_seconds() / 2,
                wake_in=lambda: fold.wake_in,
                publish_beats=lambda lease: self._etcd_backend.publish_beats(lease=lease),
            )

    def _offer_to_lead(self, token: int, scaled: bool) -> None:
        folder = self._folder
        if folder is None:
            return
        try:
            folder.offer_to_lead(token, scaled)
        except EtcdError as exc:  # best effort: the next offer, or another agent, leads
            log.warning("rendezvous_join_folder_error", error=str(exc))

    def _stop_folding(self) -> None:
        folder, self._folder = self._folder, None
        if folder is not None:
            folder.stop()
        if self._requester is not None:
            try:
                self._requester.withdraw()
            except RendezvousError as exc:  # the fold drops it as stale rounds later
                log.warning("rendezvous_join_request_left", error=str(exc))

    @property
    def joined_round(self) -> int | None:
        """The round this node's last ``next_rendezvous`` joined (None before the first)."""
        return self._joined_round

    def settle_until(self, formed: Callable[[int], bool]) -> None:
        """Let every round this node joins settle (:mod:`.settling`, rule 2) until
        ``formed(round)`` says this node's workers formed their process group."""
        interval = self._settings.keep_alive_interval.total_seconds()
        self._settling = Settling(formed, grace=interval * self._settings.keep_alive_max_attempt)
        self._watched_holder.settling = functools.partial(self._settles, judging=True)

    def _settles(self, state: _RendezvousState, *, judging: bool) -> bool:
        """Whether ``state``'s round settles for this node: it judges the participants
        (``judging``), or it beats."""
        settling = self._settling
        if settling is None or not state.complete or self._this_node not in state.participants:
            return False
        return settling.judging(state.round) if judging else settling.beating(state.round)

    def _keep_alive(self) -> None:
        """torch's heartbeat timer calls this every ``keep_alive_interval``; rule 2 decides."""
        with self._heartbeat_lock:
            deadline = self._get_deadline(self._settings.timeout.heartbeat)
            try:
                keep_alive = functools.partial(
                    keep_alive_while_awaited, beat_due=self._state_holder.beat_due,
                    settling=functools.partial(self._settles, judging=False),
                )  # fmt: skip
                self._op_executor.run(keep_alive, deadline)
            except RendezvousError as exc:
                log.warning("rendezvous_heartbeat_failed", error=str(exc))

    def shutdown(self) -> bool:
        """Close the rendezvous for every node, unless a signal is stopping this agent.

        torch 2.6's agent also calls ``shutdown()`` while it handles the
        ``SignalException`` of a SIGTERM (``LocalElasticAgent._shutdown``; 2.13
        does not). Closing then would end the whole job when one node is
        preempted, which torchrun's launcher itself avoids by skipping
        ``shutdown()`` on a signal. So a signalled agent only leaves.
        """
        try:
            if isinstance(sys.exc_info()[1], SignalException):
                self._stop_heartbeats()
                log.info("rendezvous_left_on_signal", run_id=self.settings.run_id)
                return True
            return super().shutdown()
        finally:
            # Otherwise the key stays until the run's lease expires, read by every prune.
            with contextlib.suppress(RendezvousConnectionError):
                self._etcd_backend.forget(node_name(self._this_node))
            self._etcd_backend.close()

    # -- for side rounds (rendezvous/side_round.py) ---------------------------------------

    def running_group(self, *, probe_timeout: float) -> ActiveGroup | None:
        """The job's in-process group, when its marker is valid and its head answers."""
        backend = self._etcd_backend
        return alive_group(backend.client, backend.codec, backend.run_prefix, timeout=probe_timeout)

    @property
    def base_store(self) -> Store:
        """The rendezvous store, outside any round's prefix."""
        return self._store

    @property
    def node_addr(self) -> str:
        return self._this_node.addr

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join; at least 1 once this node's round has ended elsewhere."""
        try:
            with self._heartbeat_lock:
                # torchrun asks every 0.1 s; re-reading an unchanged state (an unpickle
                # and a liveness pass over K nodes) would cost K agents K x 10 a second.
                # The heartbeat timer still syncs every keep_alive_interval to prune.
                if not self._etcd_backend.unchanged_since(self._watched_holder.token):
                    self._state_holder.sync()
        except RendezvousConnectionError as exc:
            log.warning("rendezvous_etcd_unreachable", run_id=self.settings.run_id, error=str(exc))
            return 0
        state = self._state_holder.state
        self._settles(state, judging=True)  # sees the workers' word within a monitor tick
        if not round_ended(state, self._this_node, self._joined_round):
            return len(state.wait_list)
        if self._reported_end != self._joined_round:
            self._reported_end = self._joined_round
            log.info("rendezvous_round_ended_elsewhere", round=self._joined_round)
        return max(1, len(state.wait_list))


def _is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` (the backend's or the store's) means "no etcd member answered"."""
    return isinstance(exc, EtcdUnavailableError) or isinstance(exc.__cause__, EtcdUnavailableError)


def create_handler(
    params: RendezvousParameters, *, extra_keys: frozenset[str] = frozenset()
) -> EtcdV3RendezvousHandler:
    """The torchrun handler creator for ``etcd-v3`` and ``etcd``.

    ``--rdzv-endpoint`` takes ``host[:port][,host[:port]...]``: the members of one
    etcd cluster, tried in turn. ``--rdzv-conf`` keys (torch's defaults in brackets):

    ======================  ==========  ==================================================
    key                     default     why
    ======================  ==========  ==================================================
    protocol                http        ``https`` for TLS; cacert/cert/key as torch's etcd
    cacert, cert, key       none        CA bundle, client certificate and its key (files)
    username, password      env         default ``ETCD_USERNAME``/``ETCD_PASSWORD``
    dial_timeout            5 s         bound on reaching some member: nothing hangs
    read_timeout            5 s         per request: a hung member costs this, then failover
    key_prefix              /elastic_   keys go under ``{key_prefix}/{run_id}/``; grant the
                            train       etcd role readwrite on this prefix
    ttl                     7200 s      lease of every key, renewed on write: abandoned
                                        runs clean themselves up
    secret_file             env         job secret file (at least 32 bytes): signs every
                                        value; default ``ELASTIC_TRAIN_RDZV_SECRET``
    insecure                false       ``true``: no secret, values unsigned (warned at
                                        every start); without it a secret is required
    join_timeout            600 s       also how long a rendezvous rides out an etcd outage
    last_call_timeout       1 s [30]    survivors of a failure leave their round within
                                        ~0.3 s of each other; 1 s gathers them in one
                                        round (a fraction of a second is accepted)
    keep_alive_interval     1 s [5]     heartbeat period while a rendezvous runs: a node
    keep_alive_max_attempt  3 [3]       that dies mid-rendezvous is pruned after 3 s.
                                        No heartbeats while training runs (see below)
    close_timeout           30 s        torch's default
    heartbeat_timeout       5 s         torch's default
    ======================  ==========  ==================================================

    With these, losing one node of three recovers in a few seconds instead of
    about 46 s: a participant that leaves a completed round ends it, so nobody
    waits for the dead node's heartbeat to expire (:mod:`elastic_train.rendezvous.rules`).
    While training runs an agent sends etcd almost nothing: no heartbeats, reads
    from a watched copy of the state, and one lease renewal per ``ttl / 4``.

    The creator also sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless the
    environment sets it: with torch's shared TCPStore a node joining a running
    job hangs, because rank 0 does not republish ``MASTER_ADDR``/``MASTER_PORT``
    into the new round's store.
    """
    configure_logging_if_unconfigured()  # the agent's own events: JSON, secrets redacted
    register_secret(params.config.get("password"))
    config = parse_config(params, extra_keys=extra_keys)
    if config.secret is not None:  # from a file, so log.py does not know it yet
        register_secret(config.secret.decode(errors="replace"))
    backend, store = _create_backend(params, config)
    settings = config.handler
    timeout = RendezvousTimeout(
        join=timedelta(seconds=settings.join_timeout),
        last_call=timedelta(seconds=settings.last_call_timeout),
        close=timedelta(seconds=settings.close_timeout),
        heartbeat=timedelta(seconds=settings.heartbeat_timeout),
    )
    handler = EtcdV3RendezvousHandler(
        DynamicRendezvousHandler._node_desc_generator.generate(params.local_addr),
        RendezvousSettings(
            params.run_id,
            params.min_nodes,
            params.max_nodes,
            timeout,
            keep_alive_interval=timedelta(seconds=settings.keep_alive_interval),
            keep_alive_max_attempt=settings.keep_alive_max_attempt,
        ),
        store,
        backend=backend,
    )
    if os.environ.setdefault(_SHARE_STORE_ENV, "1") == "1":
        log.info("rendezvous_tcp_store_sharing_off", reason="lets nodes join a running job")
    return handler
