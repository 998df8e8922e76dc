"""Who is still in the group after a peer failed: liveness, generations, agreement.

In-process recovery (``elastic.recovery = "inprocess"``, docs/recovery-inprocess.md)
keeps the survivors' processes. They need to agree, without torchrun, on the
members of the next process group and on a store to form it on:

- At each formation (generation ``g``) every worker starts a liveness
  responder (a thread that answers a one-byte ping) and a TCPStore server,
  and registers both addresses under ``{prefix}/inprocess/{lineage}/g{g}/``.
  The store of the next group's rank 0 is already listening when it is needed,
  and it is not the old ``MASTER_ADDR`` store, which dies with old rank 0.
- After a failed collective a survivor pings the old members (a SIGKILLed
  process refuses at once; a stopped one does not answer within the probe
  timeout) and proposes the live ones as generation ``g + 1`` with one
  create-if-absent etcd transaction. Everyone adopts the winning proposal; a
  worker that is not in it is fenced out and leaves to the restart path.

Values in etcd are framed by the job's :class:`ValueCodec` (signed with the
rendezvous secret), the same as the rendezvous' own.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from elastic_train.errors import (
    ElasticTrainError,
    InProcessRecoveryError,
    MemberLostError,
)
from elastic_train.etcd.group_marker import (
    PING,
    PONG,
    ActiveGroup,
    alive_group,
    answers,
    clear_active,
    write_active,
)
from elastic_train.log import get_logger
from elastic_train.training.etcd_access import EtcdAccess

log = get_logger(__name__)

#: Seconds between two reads of etcd while waiting for peers' registrations.
_POLL_S = 0.02
#: Seconds a joiner waits for a running group that does not answer before it leaves
#: for the restart path. A group that lost its head answers again once it re-formed
#: and its new rank 0 published the marker at its next step boundary; a recovery
#: that first waits out a step timeout (at least 5 s by default) takes that long.
HEAD_SILENCE_S = 15.0


@dataclass(frozen=True)
class Member:
    """One worker of a generation: who it is and where it answers."""

    id: str  # node/pid: unique in the job while the process lives
    host: str
    ping_port: int
    store_port: int
    #: entered by an async join, not by the rendezvous round (its agent is in a side round)
    joined: bool = False

    @property
    def node(self) -> str:
        """The node this worker runs on (its id without the pid)."""
        return self.id.rsplit("/", 1)[0]


class Endpoints:
    """This worker's liveness responder and its (idle until needed) TCPStore server."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._server = socket.create_server(("", 0), backlog=64)
        self.ping_port = self._server.getsockname()[1]
        self.store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        self._closed = False
        threading.Thread(target=self._serve, name="liveness", daemon=True).start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(1.0)
                    if conn.recv(1) == PING:
                        conn.sendall(PONG)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        # close() alone leaves a listener blocked in accept() open (Linux): it would
        # go on answering pings for a member that is gone.
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()


def probe(member: Member, *, timeout: float) -> bool:
    """Whether ``member`` answers a ping within ``timeout`` seconds."""
    return answers(member.host, member.ping_port, timeout=timeout)


def _probe_all(members: list[Member], timeout: float) -> list[bool]:
    with ThreadPoolExecutor(max_workers=max(1, len(members))) as pool:
        return list(pool.map(lambda m: probe(m, timeout=timeout), members))


@dataclass(frozen=True)
class Generation:
    """An agreed group: its number, members in rank order, and this worker's rank."""

    number: int
    members: tuple[Member, ...]
    rank: int

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def nodes(self) -> int:
        return len({m.node for m in self.members})

    @property
    def ids(self) -> frozenset[str]:
        return frozenset(m.id for m in self.members)

    @property
    def round_nodes(self) -> int:
        """Nodes whose workers came from the rendezvous round (not an async join)."""
        return len({m.node for m in self.members if not m.joined})

    def store(self, endpoints: Endpoints, *, timeout: float, probe_timeout: float) -> dist.Store:
        """A fresh-prefix store on the TCPStore of the generation's rank 0, once
        every member has arrived there. A member that stops answering pings
        meanwhile raises :class:`MemberLostError` at once: the group would never form."""
        head = self.members[0]
        if self.rank == 0:
            base: dist.Store = endpoints.store
        else:
            if not probe(head, timeout=probe_timeout):  # a client would retry until timeout
                raise MemberLostError(f"generation {self.number}: rank 0 ({head.id}) is gone")
            try:
                base = dist.TCPStore(head.host, head.store_port, is_master=False,
                                     timeout=timedelta(seconds=timeout))  # fmt: skip
            except RuntimeError as exc:
                raise MemberLostError(f"generation {self.number}: {exc}") from exc
        store = dist.PrefixStore(f"g{self.number}", base)
        self._arrive(store, timeout=timeout, probe_timeout=probe_timeout)
        return store

    def _arrive(self, store: dist.Store, *, timeout: float, probe_timeout: float) -> None:
        """Mark this member ready and wait for the others, probing the missing ones:
        survivors notice a failure at different times (at their next collective)."""
        store.set(f"ready/{self.rank}", "1")
        missing = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + timeout
        while missing:
            missing = [r for r in missing if not store.check([f"ready/{r}"])]
            gone = [self.members[r].id for r in missing
                    if not probe(self.members[r], timeout=probe_timeout)]  # fmt: skip
            if gone:
                raise MemberLostError(f"generation {self.number}: {gone} died before it formed")
            if missing and time.monotonic() > deadline:
                raise MemberLostError(f"generation {self.number}: {missing} never arrived")
            if missing:
                time.sleep(_POLL_S)


class Membership:
    """The generations of one lineage of groups (one torchrun attempt and its re-forms)."""

    def __init__(
        self,
        access: EtcdAccess,
        *,
        lineage: str,
        node: str,
        host: str | None = None,
        joined: bool = False,
    ) -> None:
        self.access = access
        self._client = access.client()
        self._codec = access.codec()
        self._lineage = lineage
        self._root = f"{access.prefix}/inprocess/{lineage}"
        self.me = Member(f"{node}/{os.getpid()}", "", 0, 0, joined)
        self._endpoints = Endpoints(host or socket.getfqdn())
        self.me = Member(
            self.me.id, self._endpoints.host, self._endpoints.ping_port,
            self._endpoints.store.port, joined,
        )  # fmt: skip
        self.current: Generation | None = None

    @property
    def endpoints(self) -> Endpoints:
        return self._endpoints

    def _put(self, key: str, value: object) -> None:
        raw = key.encode()
        self._client.put(raw, self._codec.encode(raw, json.dumps(value).encode()))

    def _decode(self, key: bytes, value: bytes) -> object:
        return json.loads(self._codec.decode(key, value))

    def register(self, *, rank: int, world_size: int, deadline: float) -> Generation:
        """Generation 0: every rank of the group torchrun formed registers; wait for all."""
        prefix = f"{self._root}/g0/"
        self._put(f"{prefix}{rank:06d}", asdict(self.me))
        while True:
            kvs, _ = self._client.get_prefix(prefix.encode())
            if len(kvs) >= world_size:
                break
            if time.monotonic() > deadline:
                raise InProcessRecoveryError(
                    f"only {len(kvs)} of {world_size} workers registered under {prefix}"
                )
            time.sleep(_POLL_S)
        members = tuple(
            Member(**self._decode(kv.key, kv.value))  # type: ignore[arg-type]
            for kv in sorted(kvs, key=lambda kv: kv.key)
        )
        self.current = Generation(0, members, rank)
        return self.current

    def agree(self, *, probe_timeout: float) -> Generation:
        """The next generation: the live members, as the first proposal to reach etcd
        said. Raises :class:`InProcessRecoveryError` when this worker is not in it."""
        current = self.current
        assert current is not None, "register() first"
        others = [m for m in current.members if m.id != self.me.id]
        alive = dict(zip((m.id for m in others), _probe_all(others, probe_timeout), strict=True))
        proposal = [m for m in current.members if m.id == self.me.id or alive[m.id]]
        written, members = self._propose(current.number + 1, proposal)
        number, members = self._newest(current.number + 1, members)
        ids = [m.id for m in members]
        log.info(
            "membership_agreed", generation=number, proposed=written, members=ids,
            dead=[i for i, ok in alive.items() if not ok], skipped=number - current.number - 1,
        )  # fmt: skip
        return self._adopt(number, members)

    def _newest(self, number: int, members: tuple[Member, ...]) -> tuple[int, tuple[Member, ...]]:
        """The newest generation from ``number`` on. A member late to ``number`` (its
        failed collective took longer) finds the others gone on to a later one: they
        waited for it in ``number``'s store and gave up. It joins them there, or is
        fenced out by it, instead of forming ``number`` alone and timing out."""
        try:
            later, _ = self._generations_from(number + 1)
        except ElasticTrainError as exc:
            raise InProcessRecoveryError(f"no agreement after generation {number}: {exc}") from exc
        return later[-1] if later else (number, members)

    @property
    def _generations(self) -> bytes:
        """The prefix of the generation keys (``{number:06d}`` follows it)."""
        return f"{self._root}/gen/".encode()

    def _generation_key(self, number: int) -> bytes:
        return self._generations + f"{number:06d}".encode()

    def _generations_from(self, number: int) -> tuple[list[tuple[int, tuple[Member, ...]]], int]:
        """Generations ``number`` and later (not every one of a long run), oldest
        first, each verified; and the revision they were read at."""
        prefix = self._generations
        kvs, revision = self._client.get_prefix(prefix, start=self._generation_key(number))
        found = [
            (int(kv.key[len(prefix) :]), tuple(Member(**m) for m in self._decode(kv.key, kv.value)))  # type: ignore[union-attr]
            for kv in sorted(kvs, key=lambda kv: kv.key)
        ]
        return found, revision

    def _propose(self, number: int, proposal: list[Member]) -> tuple[bool, tuple[Member, ...]]:
        """Create generation ``number`` as ``proposal`` unless it exists; the winner."""
        key = self._generation_key(number)
        try:
            value = self._codec.encode(key, json.dumps([asdict(m) for m in proposal]).encode())
            written, existing, _ = self._client.put_if_value(key, value, expected=None)
            if written:
                return True, tuple(proposal)
            winner = self._decode(key, existing.value)  # type: ignore[union-attr]
        except ElasticTrainError as exc:
            raise InProcessRecoveryError(f"no agreement on generation {number}: {exc}") from exc
        return False, tuple(Member(**m) for m in winner)  # type: ignore[union-attr]

    def _adopt(self, number: int, members: tuple[Member, ...]) -> Generation:
        ids = [m.id for m in members]
        if self.me.id not in ids:
            raise InProcessRecoveryError(
                f"fenced out of generation {number}: the others agreed on {ids} without this "
                "worker (it did not answer their liveness probe in time)"
            )
        self.current = Generation(number, members, ids.index(self.me.id))
        return self.current

    # -- async joins (training/admission.py) -------------------------------------------

    @property
    def lineage(self) -> str:
        return self._lineage

    def publish_active(self) -> None:
        """Rank 0, at each formation: tell nodes entering the job where to ask to join."""
        gen = self.current
        assert gen is not None and gen.rank == 0
        group = ActiveGroup(self._lineage, gen.number, gen.nodes, self.me.host, self.me.ping_port)
        write_active(self._client, self._codec, self.access.prefix, group)

    def retire_active(self) -> None:
        """This lineage ends (finished, or the restart path): no more joins to it."""
        clear_active(self._client, self._codec, self.access.prefix, self._lineage)

    def marker_answers(self, *, timeout: float) -> bool:
        """Whether this lineage's group answers at the head its marker names now: a group
        that re-formed without its old rank 0 answers at the new one's."""
        try:
            group = alive_group(self._client, self._codec, self.access.prefix, timeout=timeout)
        except ElasticTrainError as exc:  # etcd's: not an answer, the next look asks again
            log.warning("inprocess_marker_unreadable", error=str(exc))
            return False
        return group is not None and group.lineage == self._lineage

    def request_join(self) -> None:
        self._put(f"{self._root}/joins/{self.me.id}", asdict(self.me))

    def join_requests(self) -> tuple[list[Member], int]:
        """The members asking to join (oldest first) and the revision read at."""
        kvs, revision = self._client.get_prefix(f"{self._root}/joins/".encode())
        members = [Member(**self._decode(kv.key, kv.value)) for kv in kvs]  # type: ignore[arg-type]
        return members, revision

    def watch_joins(self, *, start_revision: int, timeout: float) -> None:
        """Block until the join requests change after ``start_revision``, or ``timeout``."""
        prefix = f"{self._root}/joins/".encode()
        self._client.watch_once(prefix, prefix=True, start_revision=start_revision, timeout=timeout)

    def withdraw_requests(self, members: list[Member]) -> None:
        for member in members:
            self._client.delete(f"{self._root}/joins/{member.id}".encode())

    def admit(self, joiners: list[Member], *, propose: bool, deadline: float) -> Generation:
        """Generation g + 1 = the current members and ``joiners``, proposed by the one
        member with ``propose`` (rank 0) and read by the others; a failure's proposal
        that won instead is adopted the same way (the joiners then wait for the next)."""
        current = self.current
        assert current is not None
        number = current.number + 1
        if propose:
            _, members = self._propose(number, [*current.members, *joiners])
            return self._adopt(number, members)
        key = self._generation_key(number)
        head, next_look = current.members[0], time.monotonic() + 1.0
        while (read := self._client.get(key))[0] is None:
            now = time.monotonic()
            if now > next_look:  # rank 0 may die before it proposes
                if not probe(head, timeout=1.0):
                    raise MemberLostError(f"rank 0 ({head.id}) died before it proposed {number}")
                next_look = now + 1.0
            if now > deadline:
                raise InProcessRecoveryError(f"generation {number} never came from rank 0")
            self._wait_change(key, prefix=False, revision=read[1], until=min(next_look, deadline))
        kv = read[0]
        assert kv is not None
        members = tuple(Member(**m) for m in self._decode(key, kv.value))
        return self._adopt(number, members)

    def _wait_change(self, key: bytes, *, prefix: bool, revision: int, until: float) -> None:
        """Until ``key`` (or a key under it) changes after ``revision``, or ``until`` (on
        ``time.monotonic()``). etcd wakes the waiter as the generation is written: the
        members of an admission wait for it in the group's formation, and a poll every
        0.1 s made them wait 50 ms for the joiner on average."""
        timeout = max(0.01, until - time.monotonic())
        self._client.watch_once(key, prefix=prefix, start_revision=revision + 1, timeout=timeout)

    def await_admission(
        self, *, after: int, deadline: float, head: Callable[[], bool],
        silence_s: float = HEAD_SILENCE_S,
    ) -> Generation:  # fmt: skip
        """The joiner: the first generation after ``after`` that holds this worker.
        ``head()`` is asked about once a second whether the group still answers: a
        group that went to the restart path admits nobody, so the joiner goes too
        once it has not answered for ``silence_s``."""
        next_look = answered = time.monotonic()
        while True:
            later, revision = self._generations_from(after + 1)
            for number, members in later:
                if self.me.id in (m.id for m in members):
                    return self._adopt(number, members)
            now = time.monotonic()
            if now > deadline:
                raise InProcessRecoveryError(
                    f"not admitted to the running group (lineage {self._lineage}) in time"
                )
            if now > next_look:
                if head():
                    answered = now
                elif now - answered > silence_s:
                    raise InProcessRecoveryError(
                        f"the running group (lineage {self._lineage}) stopped answering "
                        f"for {now - answered:.0f}s before it admitted this worker"
                    )
                next_look = now + 1.0
            until = min(next_look, deadline)
            self._wait_change(self._generations, prefix=True, revision=revision, until=until)

    def stop_answering(self) -> None:
        """Leaving the group: the others' next liveness probe is refused at once."""
        self._endpoints.close()

    def close(self) -> None:
        self._endpoints.close()
        self._client.close()
