"""Async joins (issue 20, item 2): a node entering a job whose in-process group runs
is admitted at a step boundary; the members keep their processes.

Real etcd throughout. The pieces: the side round a joiner's agent gets
(``rendezvous/side_round.py``, real rendezvous handlers), the join requests and
the admission in etcd (``training/membership.py``, ``training/admission.py``,
real liveness responders), and one end-to-end run: real torchrun nodes, a node
SIGKILLed and started again, which must join without any survivor restarting,
and end where a fault-free run does.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog
import torch
import torch.distributed as dist
from chaos_runs import (
    assert_completed_exactly_once,
    assert_ran_exactly_once,
    log_events,
    resumes_by_process,
    worker_records,
)
from rendezvous_threads import poll_until
from steered_runs import STEERED_MLP, Pace, assert_ends_like, run_steered
from torch.distributed import distributed_c10d as c10d
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch_support import needs_inprocess

from elastic_train.audit import AuditTail, StepRecord
from elastic_train.errors import InProcessRecoveryError, MemberLostError
from elastic_train.etcd.codec import ValueCodec
from elastic_train.etcd.group_marker import ActiveGroup, write_active
from elastic_train.rendezvous import backend as rendezvous
from elastic_train.rendezvous.side_round import ASYNC_JOIN_ENV, attach_side_rounds
from elastic_train.torchrun_plugin import inprocess_etcd_env
from elastic_train.training import next_group
from elastic_train.training.admission import ASYNC_JOIN_ENV as WORKER_ENV
from elastic_train.training.admission import JoinTicket, JoinWatch
from elastic_train.training.etcd_access import ETCD_ENV, EtcdAccess
from elastic_train.training.membership import HEAD_SILENCE_S, Generation, Member, Membership
from elastic_train.training.next_group import Formation

# -- the side round -------------------------------------------------------------------


@pytest.fixture
def params(etcd_endpoint: str, rdzv_secret_file: Path) -> RendezvousParameters:
    return RendezvousParameters(
        "etcd-v3", etcd_endpoint, f"ajoin-{uuid.uuid4().hex[:8]}", 1, 3,
        last_call_timeout=0.2, secret_file=str(rdzv_secret_file),
    )  # fmt: skip


@pytest.fixture
def access(params: RendezvousParameters, monkeypatch: pytest.MonkeyPatch) -> EtcdAccess:
    monkeypatch.setenv(ASYNC_JOIN_ENV, "")  # removed again after the test
    monkeypatch.setenv(ETCD_ENV, inprocess_etcd_env(params))
    return EtcdAccess.from_env()


def _member(access: EtcdAccess, node: str, *, lineage: str, joined: bool = False) -> Membership:
    return Membership(access, lineage=lineage, node=node, host="127.0.0.1", joined=joined)


def test_a_node_entering_a_running_group_gets_a_round_of_its_own(
    params: RendezvousParameters, access: EtcdAccess
) -> None:
    first, joiner = rendezvous.create_handler(params), rendezvous.create_handler(params)
    for handler in (first, joiner):
        attach_side_rounds(handler, max_nodes=3)
    head = _member(access, "node0", lineage=uuid.uuid4().hex)
    try:
        # No group marked yet: the rendezvous' own round (this agent alone, min 1).
        info = first.next_rendezvous()
        assert info.world_size == 1 and not os.environ.get(ASYNC_JOIN_ENV)
        head.register(rank=0, world_size=1, deadline=time.monotonic() + 30)
        head.publish_active()

        side = joiner.next_rendezvous()
        assert (side.rank, side.world_size) == (0, 1)
        ticket = JoinTicket.from_env()
        assert ticket is not None and ticket.lineage == head.lineage
        assert (ticket.host, ticket.ping_port) == (head.me.host, head.me.ping_port)
        assert WORKER_ENV == ASYNC_JOIN_ENV
        # The round's agent sees nobody waiting: it keeps its workers.
        assert first.num_nodes_waiting() == 0
        assert first.running_group(probe_timeout=1.0) is not None
    finally:
        head.close()
        for handler in (first, joiner):
            handler.shutdown()


def test_a_group_whose_head_is_gone_or_whose_marker_is_forged_is_not_joined(
    params: RendezvousParameters, access: EtcdAccess
) -> None:
    handler = rendezvous.create_handler(params)
    head = _member(access, "node0", lineage=uuid.uuid4().hex)
    try:
        head.register(rank=0, world_size=1, deadline=time.monotonic() + 30)
        head.publish_active()
        assert handler.running_group(probe_timeout=1.0) is not None
        head.close()  # its liveness responder with it
        assert handler.running_group(probe_timeout=1.0) is None
        # A marker that fails the job secret's MAC is never trusted.
        client = access.client()
        try:
            forged = ActiveGroup("x", 0, 1, "127.0.0.1", 1)
            write_active(client, ValueCodec(b"another secret of 32 bytes or more!"), access.prefix,
                         forged)  # fmt: skip
            assert handler.running_group(probe_timeout=1.0) is None
        finally:
            client.close()
    finally:
        handler.shutdown()


# -- the requests and the admission in etcd ------------------------------------------


@pytest.fixture
def group(access: EtcdAccess) -> Iterator[tuple[Membership, Membership]]:
    """Generation 0 of a running group of two: rank 0 (node0) and rank 1 (node1)."""
    name = uuid.uuid4().hex
    head, other = _member(access, "node0", lineage=name), _member(access, "node1", lineage=name)
    deadline = time.monotonic() + 30
    thread = threading.Thread(target=other.register, kwargs={"rank": 1, "world_size": 2,
                                                              "deadline": deadline})  # fmt: skip
    thread.start()
    head.register(rank=0, world_size=2, deadline=deadline)
    thread.join(30)
    yield head, other
    head.close()
    other.close()


def test_rank0_admits_the_live_joiners_up_to_the_node_limit(
    access: EtcdAccess, group: tuple[Membership, Membership]
) -> None:
    head, other = group
    live = _member(access, "node2", lineage=head.lineage, joined=True)
    gone = _member(access, "node3", lineage=head.lineage, joined=True)
    extra = _member(access, "node4", lineage=head.lineage, joined=True)
    watch = JoinWatch(head)
    try:
        with seen_when_logged("inprocess_join_requested", watch.wanted) as votes:
            for member in (live, gone, extra):
                member.request_join()
            gone.close()  # asked, then died before the group admitted it
            poll_until(lambda: len(watch._requests) == 3, within=30, what="the three requests")
        # Once the watch says a node asks, rank 0's next check votes for it.
        assert votes and all(votes), votes
        assert watch.wanted()
        admitted = watch.admissible(probe_timeout=1.0)
        # node3 does not answer (its request is withdrawn); node4 is over --nnodes' 3.
        assert [m.id for m in admitted] == [live.me.id]
        requests, _ = head.join_requests()
        assert gone.me.id not in {m.id for m in requests}

        gen = head.admit(admitted, propose=True, deadline=time.monotonic() + 30)
        # At --nnodes' maximum, a waiting node is no reason to vote for an admission.
        assert not watch.wanted()
        assert [m.id for m in gen.members] == [head.me.id, other.me.id, live.me.id]
        # The other member reads the generation rank 0 proposed; the joiner finds it.
        assert other.admit([], propose=False, deadline=time.monotonic() + 30) == gen.__class__(
            1, gen.members, 1
        )
        joined = live.await_admission(after=0, deadline=time.monotonic() + 30, head=lambda: True)
        assert (joined.number, joined.rank, joined.nodes) == (1, 2, 3)
        # node2's worker came from no rendezvous round: the exit barrier counts 2 nodes.
        assert joined.round_nodes == 2
    finally:
        watch.close()
        for member in (live, extra):
            member.close()


@pytest.fixture
def joiner(access: EtcdAccess, group: tuple[Membership, Membership]) -> Iterator[Membership]:
    """node2, entering the running ``group`` (it has not asked yet)."""
    member = _member(access, "node2", lineage=group[0].lineage, joined=True)
    yield member
    member.close()


def test_a_joiner_leaves_when_the_group_stops_answering(joiner: Membership) -> None:
    joiner.request_join()
    started = time.monotonic()
    with pytest.raises(InProcessRecoveryError, match="stopped answering"):
        joiner.await_admission(after=0, deadline=started + 120, head=lambda: False,
                               silence_s=2.0)  # fmt: skip
    assert time.monotonic() - started < 60  # long before its deadline
    assert HEAD_SILENCE_S < 60  # and so is the default silence


def test_a_joiner_waits_out_a_group_that_is_silent_while_it_re_forms(
    group: tuple[Membership, Membership], joiner: Membership
) -> None:
    # The ticket's head died and the group is re-forming: silent for a while, then
    # its new rank 0 answers. The joiner must still be there to be admitted.
    head, _ = group
    joiner.request_join()
    started = time.monotonic()
    speaks = lambda: time.monotonic() > started + 3.5  # noqa: E731
    with pytest.raises(InProcessRecoveryError, match="stopped answering"):
        joiner.await_admission(after=0, deadline=started + 60, head=speaks, silence_s=1.0)
    admitting = threading.Timer(5.0, head.admit, args=([joiner.me],),
                                kwargs={"propose": True, "deadline": started + 60})  # fmt: skip
    admitting.start()
    gen = joiner.await_admission(after=0, deadline=started + 60, head=speaks, silence_s=10.0)
    admitting.join()
    assert gen.number == 1 and joiner.me.id in {m.id for m in gen.members}
    assert time.monotonic() - started >= 5.0  # it was silent, then admitted


def test_the_marker_tells_a_joiner_where_its_group_answers_now(
    access: EtcdAccess, group: tuple[Membership, Membership], joiner: Membership
) -> None:
    head, other = group
    client = access.client()
    codec = access.codec()
    try:
        assert not joiner.marker_answers(timeout=1.0)  # no marker yet
        # Old rank 0 is gone; the group re-formed and its new rank 0 published itself.
        moved = ActiveGroup(head.lineage, 1, 1, other.me.host, other.me.ping_port)
        write_active(client, codec, access.prefix, moved)
        assert joiner.marker_answers(timeout=1.0)
        # Another lineage's group (after the restart path) admits nobody of this one.
        write_active(client, codec, access.prefix,
                     ActiveGroup("another", 0, 1, other.me.host, other.me.ping_port))  # fmt: skip
        assert not joiner.marker_answers(timeout=1.0)
        write_active(client, codec, access.prefix, moved)
        other.close()  # and this head dies too
        assert not joiner.marker_answers(timeout=1.0)
    finally:
        client.close()


# -- the next group, formed in the background (training/next_group.py) -------------------


@contextlib.contextmanager
def seen_when_logged(event: str, probe: Callable[[], object]) -> Iterator[list[object]]:
    """What ``probe()`` returned at each ``event`` line, read in the logging thread
    as the line is written. A test that acts on a line (the gates of
    :func:`test_a_joiner_admitted_after_the_last_step_loads_the_members_final_state`)
    relies on the state the line announces being readable by then."""
    seen: list[object] = []

    def look(_logger: object, _name: str, event_dict: dict) -> dict:
        if event_dict.get("event") == event:
            seen.append(probe())
        return event_dict

    processors = structlog.get_config()["processors"]
    processors.insert(0, look)  # in place, as structlog.testing.capture_logs does
    try:
        yield seen
    finally:
        processors.remove(look)


def _formations(group: tuple[Membership, Membership], joiners: list) -> list[Formation]:
    return [Formation(m, joiners, propose=m is group[0], timeout=20, op_timeout=20,
                      probe_timeout=1.0) for m in group]  # fmt: skip


@needs_inprocess
def test_the_members_form_the_next_group_with_the_joiner_while_they_train(
    group: tuple[Membership, Membership], joiner: Membership
) -> None:
    # The members' formations run in threads (their main threads would train);
    # the joiner forms its side as enter() does, on the generation that holds it.
    joiner.request_join()
    formations: list[Formation] = []
    ready = lambda: sum(f.ready for f in formations)  # noqa: E731
    with seen_when_logged("inprocess_next_group_formed", ready) as seen:
        formations.extend(_formations(group, [joiner.me]))
        gen = joiner.await_admission(after=0, deadline=time.monotonic() + 30, head=lambda: True)
        store = gen.store(joiner.endpoints, timeout=20, probe_timeout=1.0)
        joined = next_group.form(store, gen, timeout=20)
        joined.group.barrier().wait()
        poll_until(lambda: ready() == 2, within=30, what="both members formed")
    # The k-th member to say it formed the group is at least the k-th one ready: a
    # check step after the line counts it (the gates of the join after the last step).
    assert len(seen) == 2 and seen[0] >= 1 and seen[1] == 2, seen  # type: ignore[operator]
    taken = [f.take() for f in formations]
    assert [g.number for g, _, _ in taken] == [1, 1] and gen.number == 1
    assert [m.node for m in taken[0][0].members] == ["node0", "node1", "node2"]
    groups = [new.group for _, new, _ in taken] + [joined.group]
    assert {g.group_name for g in groups} == {"inprocess-g1"}
    # One group of three: an all-reduce over it sums every rank's value.
    tensors = [torch.tensor([float(10**rank)]) for rank in range(3)]
    works = [g.allreduce([t]) for g, t in zip(groups, tensors, strict=True)]
    for work in works:
        work.wait()
    assert [t.item() for t in tensors] == [111.0] * 3
    assert all(seconds["formation_s"] >= 0 for _, _, seconds in taken)


@needs_inprocess
def test_a_next_group_whose_joiner_died_fails_on_every_member_without_hanging(
    group: tuple[Membership, Membership], joiner: Membership
) -> None:
    joiner.request_join()
    formations: list[Formation] = []
    failed = lambda: sum(f.failed for f in formations)  # noqa: E731
    with seen_when_logged("inprocess_next_group_failed", failed) as seen:
        formations.extend(_formations(group, [joiner.me]))
        joiner.close()  # admitted, then dead before it reached the new generation's store
        poll_until(lambda: failed() == 2, within=30, what="both formations end")
    assert len(seen) == 2 and seen[0] >= 1 and seen[1] == 2, seen  # type: ignore[operator]
    assert all(f.error and "node2" in f.error for f in formations), [f.error for f in formations]
    for formation in formations:
        formation.drop()
    assert group[0].current is not None and group[0].current.number == 1


def test_an_installed_group_is_torchs_default_group_and_goes_like_one() -> None:
    # install() writes torch's registry itself below 2.13 (bash .ci/torch-floor runs
    # this on 2.6): 2.8-2.12, where in process runs too, form next groups in the background.
    assert next_group.available("gloo")
    gen = Generation(number=7, members=(Member("node0/1", "127.0.0.1", 0, 0),), rank=0)
    formed = next_group.form(dist.HashStore(), gen, timeout=10)
    assert not dist.is_initialized()  # formed, known to no registry yet
    next_group.install(formed)
    try:
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "gloo")
        assert c10d._get_default_group().group_name == "inprocess-g7"
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        sub = dist.new_group([0])
        dist.all_reduce(tensor, group=sub)
        assert tensor.tolist() == [1.0, 1.0] and dist.get_process_group_ranks(sub) == [0]
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized() and not c10d._world.pg_map and not c10d._world.tags_to_pg


# -- end to end ------------------------------------------------------------------------

JOIN_STEPS = 500
#: The pause of a step from the kill until the rejoined world trains: the 440 steps
#: after the join's trigger (about 20 s at 45 ms) give a joiner time to start and be
#: admitted (about 5 s on a loaded 2-core box); the steps after the join run unpaced.
JOIN_PAUSE_S = 0.03


@needs_inprocess
@pytest.mark.slow
def test_a_node_killed_and_started_again_joins_without_restarting_anyone(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "chaos"
    # Steps of 10-50 ms, so that the ranks agree (the check step's all-reduce, about
    # every 0.25 s) every few steps, not every step: the joiner must take up the
    # members' schedule at once (a check step one rank runs and another does not is a
    # collective that hangs). The join comes 1 s or more after the kill, once its
    # recovery is over.
    job = [*STEERED_MLP, f"--training.steps={JOIN_STEPS}"]
    pace = Pace(tmp_path / "pause", 0.005)
    command = [
        "--nodes", "3", "--min-nodes", "2", "--chaos", "kill:1@step20,join:1@step60",
        "--run-dir", str(run_dir), "--timeout", "240", "--metrics-port", "0", *job,
        f"--model.options.pause_file={pace.path}", "--elastic.recovery=inprocess",
        "--elastic.pg_timeout_seconds=10",
    ]  # fmt: skip
    summary = run_steered(run_dir, command, pace=pace, nodes=3, join_wait=JOIN_PAUSE_S)
    assert_completed_exactly_once(summary, steps=JOIN_STEPS)
    assert [r["restore_source"] for r in summary["recoveries"]] == ["inprocess", "inprocess"]
    # Audit files are per process: node0 and node2 each kept one process through
    # the kill and the join; node1's new worker wrote nothing before it was admitted.
    resumes = resumes_by_process(run_dir)
    by_node: dict[str, list[list[tuple[str, int]]]] = {}
    for name, starts in resumes.items():
        by_node.setdefault(name.split("-")[1], []).append(starts)
    for survivor in ("node0", "node2"):
        (starts,) = by_node[survivor]
        assert starts[1:] == [("inprocess", 2), ("inprocess", 3)], starts
    assert len(by_node["node1"]) == 2 and [("inprocess", 3)] in by_node["node1"], by_node
    assert log_events(run_dir / "logs" / "node1.log", "rendezvous_side_round")
    # The joiner paid its first step's set-up before it asked: once, on its own.
    (warmed,) = log_events(run_dir / "logs" / "node1.log", "inprocess_join_warmed")
    (joined,) = log_events(run_dir / "logs" / "node1.log", "inprocess_joined")
    assert warmed["timestamp"] < joined["timestamp"] and warmed["world_size"] == 1, warmed
    (admitted,) = log_events(run_dir / "logs" / "node0.log", "inprocess_admitted")
    assert admitted["old_world_size"] == 2 and admitted["world_size"] == 3
    assert [j.split("/")[0] for j in admitted["joiners"]] == ["node1"]
    # The next group formed while the members trained: they switched steps later.
    assert admitted["formation_s"] > 0 and admitted["steps_while_forming"] >= 1, admitted
    _check_healed(run_dir, admitted)
    # Every agent exited 0 by itself: the final rank 0 released the round's exit
    # barrier for the killed node1 agent, and the new one's side round had its own.
    assert set(summary["nodes"].values()) == {"exited(0)"}, summary["nodes"]
    released = log_events(run_dir / "logs" / "node0.log", "exit_barrier_released")
    assert [(e["agents"], e["present"], e["departed"]) for e in released] == [(3, 2, 1)]
    # No check step ran into the training steps of the others (each would have ended
    # in a step timeout and a re-form with the same members).
    started = {node: len(log_events(run_dir / "logs" / f"{node}.log", "inprocess_recovery_started"))
               for node in ("node0", "node1", "node2")}  # fmt: skip
    assert started == {"node0": 1, "node1": 0, "node2": 1}, started  # the kill's, only
    # Steps at world sizes 3, 2 and 3 drift from one process's summation order by up to
    # ~1e-5; a step skipped or repeated moves a weight by more than the tolerance.
    assert_ends_like(summary, run_dir, tmp_path / "reference", job, atol=2.5e-5)


def _check_healed(run_dir: Path, admitted: dict) -> None:
    """The joiner got the model and the optimizer from rank 0 during the step after
    the switch (``training/heal.py``), which the members' shares covered alone; no
    broadcast of the state. (The broadcast at a switch, ``elastic.heal_joins=false``:
    ``test_state_transfer_faults.py``'s ``[kill]`` and ``benchmarks.join_heal``.)"""
    logs = {node: run_dir / "logs" / f"{node}.log" for node in ("node0", "node1", "node2")}
    broadcasts = [  # the kill's re-form may have had one, at its own step
        e for path in logs.values() for e in log_events(path, "inprocess_newest_broadcast")
        if e["step"] == admitted["step"]
    ]  # fmt: skip
    assert not broadcasts, broadcasts
    (got,) = log_events(logs["node1"], "inprocess_healed")
    (sent,) = log_events(logs["node0"], "inprocess_heal_sent")
    assert got["step"] == sent["step"] == admitted["step"] and got["bytes"] == sent["bytes"] > 0
    records = [r for r in worker_records(run_dir, "step") if r["step"] == admitted["step"] + 1]
    by_node = {r["node"]: r["indices"] for r in records if r["world_size"] == 3}
    assert by_node["node1"] == [] and by_node["node0"] and by_node["node2"], by_node


#: steps of the join at the last boundary; its pace keeps every step a check step
#: (preemption.CHECK_SECONDS, 0.25 s), where rank 0's vote and the group's readiness go
SETTLE_STEPS = 8
SETTLE_PACE_S = 0.3


@needs_inprocess
@pytest.mark.slow
def test_a_joiner_admitted_after_the_last_step_loads_the_members_final_state(
    tmp_path: Path,
) -> None:
    """A join admitted at the boundary after the run's last step has no step to heal
    in: the joiner loads what rank 0 sent as it is (``heal.settle``) before the run's
    final collectives, and ends with rank 0's final weights.

    The test opens gates in order (``fault_hooks``' ``wait_dir``): the joiner asks
    while the members wait in step 7; rank 0's vote goes with step 7's check once it
    saw the request; the members wait in step 8 until both formed the next group, so
    step 8's check finds it ready and the switch comes after the last step."""
    run_dir, gates = tmp_path / "run", tmp_path / "gates"
    gates.mkdir()
    last = SETTLE_STEPS
    pace = Pace(tmp_path / "pause", SETTLE_PACE_S)
    command = [
        "--nodes", "2", "--min-nodes", "1", "--chaos", "join:2@step1",
        "--run-dir", str(run_dir), "--timeout", "240", "--metrics-port", "0",
        "--data.name=synthetic", "--data.num_samples=96", "--training.global_batch_size=16",
        f"--training.steps={last}", "--training.micro_batch_size=0",
        "--model.name=tests.fault_hooks:probe_mlp", f"--model.options.pause_file={pace.path}",
        f"--model.options.wait_dir={gates}", f"--model.options.wait_at_steps={last - 1},{last}",
        # The gates hold steps for seconds: no step timeout (pg_timeout_seconds throughout).
        "--elastic.recovery=inprocess", "--elastic.inprocess_timeout_multiple=0",
    ]  # fmt: skip
    logs = run_dir / "logs"
    tail, reached = AuditTail(run_dir / "audit"), [0]

    def members(event: str) -> list[list[dict]]:  # either member may be rank 0
        paths = [logs / f"node{i}.log" for i in (0, 1)]
        return [log_events(path, event) if path.exists() else [] for path in paths]

    def open_gates() -> None:
        reached[0] = max([reached[0], *(r.step for r in tail.poll() if isinstance(r, StepRecord))])
        if (gates / "joiner-waiting").exists() and reached[0] >= last - 1:
            (gates / "go-joiner").touch()
        if (gates / "go-joiner").exists() and any(members("inprocess_join_requested")):
            (gates / f"go-{last - 1}").touch()
        if all(members("inprocess_next_group_formed")):
            (gates / f"go-{last}").touch()

    summary = run_steered(run_dir, command, pace=pace, nodes=0, on_tick=open_gates)
    assert_ran_exactly_once(summary, steps=last)  # the join's recovery has no step after it
    admitted = [e for events in members("inprocess_admitted") for e in events]
    assert [(e["step"], e["world_size"]) for e in admitted] == [(last, 3)] * 2, admitted
    (started,) = log_events(logs / "node2.log", "inprocess_heal_started")
    (healed,) = log_events(logs / "node2.log", "inprocess_healed")
    (sent,) = [e for events in members("inprocess_heal_sent") for e in events]
    assert started["role"] == "joiner" and started["step"] == healed["step"] == last
    assert healed["bytes"] == sent["bytes"] > 0
    assert not [r for r in worker_records(run_dir, "step") if r["node"] == "node2"]
    final = torch.load(run_dir / "audit" / "final_params.pt", weights_only=True)
    joiner = torch.load(gates / "joiner-final.pt", weights_only=True)
    assert final.keys() == joiner.keys()
    for name, value in final.items():
        assert torch.equal(joiner[name], value), name


def test_a_member_waiting_for_rank0s_proposal_notices_that_rank0_died(
    group: tuple[Membership, Membership],
) -> None:
    """The others wait for generation g + 1 from rank 0; if rank 0 dies first, they
    leave the wait (to an ordinary failure's agreement) instead of waiting it out."""
    head, other = group
    head.close()  # its liveness responder with it
    started = time.monotonic()
    with pytest.raises(MemberLostError, match="died before it proposed 1"):
        other.admit([], propose=False, deadline=started + 120)
    assert time.monotonic() - started < 60
