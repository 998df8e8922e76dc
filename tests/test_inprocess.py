"""In-process recovery (``elastic.recovery = "inprocess"``): survivors keep their processes.

- the switch and what it needs, refused before any process group;
- the membership agreement with real etcd and real processes: a SIGKILLed and
  a SIGSTOPped member are left out, every survivor adopts the same generation,
  and the stopped one, resumed, finds itself fenced;
- end to end: ``elastic-train local`` on 3 nodes, node 1 killed, then the node
  of rank 0 (its store dies with it): the same worker processes go on at world
  sizes 2 and 1, exactly once, and end where a fault-free single process does.
  The forwards pause 0.1 s until the world of 1 trains (``steered_runs``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch.distributed as dist
from chaos_runs import ENV, log_events, resumes_by_process
from steered_runs import Pace, assert_ends_like, run_steered
from torch_support import needs_inprocess
from workers import start_workers

from elastic_train.audit import AuditTail, StepRecord
from elastic_train.config.load import load_config
from elastic_train.errors import ConfigError
from elastic_train.torchrun_plugin import INPROCESS_ETCD_ENV
from elastic_train.training.distributed import (
    WorkerEnv,
    generation_attempt_id,
    init_distributed,
)
from elastic_train.training.etcd_access import ETCD_ENV, EtcdAccess
from elastic_train.training.inprocess import abort_group

STEPS = 40
TRAINER_ARGS = [
    "--data.name=synthetic",
    "--data.num_samples=96",
    "--training.global_batch_size=16",
    f"--training.steps={STEPS}",
    "--training.final_loss_samples=96",
    "--checkpoint.interval_steps=4",
    "--model.name=tests.steered_model:steered",
    # Outside steps (the first step, saves) a survivor waiting on the dead peer
    # wakes only at this limit; inside steps the adaptive step timeout applies
    # (test_inprocess_faults runs at 60 s to show that one).
    "--elastic.pg_timeout_seconds=10",
]


# -- the switch -------------------------------------------------------------------


def test_the_switch_defaults_to_auto_and_names_itself_when_wrong() -> None:
    assert load_config(None, []).elastic.recovery == "auto"
    # "auto" picks the restart path for what in process cannot run, so it loads
    assert load_config(None, ["training.batch_mode=per_worker"]).elastic.recovery == "auto"
    with pytest.raises(ConfigError, match=r"elastic\.recovery"):
        load_config(None, ["elastic.recovery=inplace"])
    with pytest.raises(ConfigError, match=r"elastic\.recovery.*batch_mode"):
        load_config(None, ["elastic.recovery=inprocess", "training.batch_mode=per_worker"])


def test_inprocess_without_the_etcd_rendezvous_is_refused_before_any_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ETCD_ENV, raising=False)
    cfg = load_config(None, ["elastic.recovery=inprocess"])
    with pytest.raises(ConfigError, match=rf"elastic\.recovery.*{ETCD_ENV}"):
        init_distributed(WorkerEnv(), cfg.elastic)
    assert not dist.is_initialized()


def test_the_plugin_and_the_worker_agree_on_the_env_and_it_holds_no_secret(
    rdzv_secret_file: Path,
) -> None:
    assert INPROCESS_ETCD_ENV == ETCD_ENV
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_train.torchrun_plugin import inprocess_etcd_env

    params = RendezvousParameters(
        backend="etcd-v3", endpoint="127.0.0.1:2379,127.0.0.2:2379", run_id="job1",
        min_nodes=2, max_nodes=4, secret_file=str(rdzv_secret_file), key_prefix="/et",
    )  # fmt: skip
    raw = inprocess_etcd_env(params)
    assert rdzv_secret_file.read_text().strip() not in raw
    access = EtcdAccess.from_env({ETCD_ENV: raw})
    assert access.endpoints == ("127.0.0.1:2379", "127.0.0.2:2379")
    assert (access.prefix, access.min_nodes) == ("/et/job1", 2)
    assert access.codec({}).signed
    # A hand-over that does not parse, or lacks a field, names the variable.
    for bad in ("{not json", json.dumps({"endpoints": ["127.0.0.1:2379"]})):
        with pytest.raises(ConfigError, match=f"environment variable {ETCD_ENV} is malformed"):
            EtcdAccess.from_env({ETCD_ENV: bad})


def test_every_member_derives_one_new_attempt_id_per_generation() -> None:
    # The switch has no collective for it: members and a joiner derive the id.
    ids = {generation_attempt_id(lineage, g) for lineage in ("0a1b2c3d4e5f", "ffffffffffff")
           for g in range(1, 51)}  # fmt: skip
    assert len(ids) == 100
    assert all(len(i) == 12 and int(i, 16) >= 0 for i in ids)
    assert generation_attempt_id("0a1b2c3d4e5f", 7) == generation_attempt_id("0a1b2c3d4e5f", 7)
    assert "0a1b2c3d4e5f" not in ids  # never generation 0's, the id torchrun's group drew


# -- the agreement ----------------------------------------------------------------

#: One member: registers generation 0, then agrees on each line read from stdin.
MEMBER = r"""
import json, sys, time
from elastic_train.errors import InProcessRecoveryError
from elastic_train.training.etcd_access import EtcdAccess
from elastic_train.training.membership import Membership
rank, world, lineage = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
m = Membership(EtcdAccess.from_env(), lineage=lineage, node=f"node{rank}", host="127.0.0.1")
m.register(rank=rank, world_size=world, deadline=time.monotonic() + 60)
print(json.dumps({"registered": rank}), flush=True)
for _ in sys.stdin:
    try:
        gen = m.agree(probe_timeout=1.0)
        out = {"generation": gen.number, "rank": gen.rank,
               "members": [x.id.split("/")[0] for x in gen.members]}
    except InProcessRecoveryError as exc:
        out = {"fenced": str(exc)}
    print(json.dumps(out), flush=True)
"""


def _member_env(etcd_endpoint: str, secret_file: Path) -> dict[str, str]:
    access = EtcdAccess(
        endpoints=(etcd_endpoint,), prefix=f"/test-inprocess/{uuid.uuid4().hex[:8]}",
        secret_file=str(secret_file),
    )  # fmt: skip
    return {**ENV, ETCD_ENV: access.to_env()}


def _start_member(rank: int, env: dict[str, str]) -> subprocess.Popen[str]:
    command = [sys.executable, "-c", MEMBER, str(rank), "4", "lineage0"]
    return subprocess.Popen(
        command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _answer(proc: subprocess.Popen[str]) -> dict:
    assert proc.stdout is not None
    for line in proc.stdout:  # log lines go to stdout too
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"member {proc.args[3]} ended without an answer")


def _wait_until_stopped(pid: int, timeout: float = 10.0) -> None:
    """``kill(SIGSTOP)`` returns before the process stops; each thread (the liveness
    responder among them) stops as it takes the signal. Wait until all have."""
    deadline = time.monotonic() + timeout
    threads = [psutil.Process(t.id) for t in psutil.Process(pid).threads()]
    while any(t.status() != psutil.STATUS_STOPPED for t in threads):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.01)


@contextlib.contextmanager
def _members(env: dict[str, str]) -> Iterator[list[subprocess.Popen[str]]]:
    """Four members, each registered in generation 0; killed (stopped ones too) after."""
    procs = [_start_member(rank, env) for rank in range(4)]
    try:
        assert [_answer(p) for p in procs] == [{"registered": r} for r in range(4)]
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(timeout=10)


def _ask(procs: list[subprocess.Popen[str]]) -> list[dict]:
    for proc in procs:  # all ask before any answers
        assert proc.stdin is not None
        proc.stdin.write("agree\n")
        proc.stdin.flush()
    return [_answer(p) for p in procs]


def test_survivors_agree_without_the_killed_and_the_stopped_member(
    etcd_endpoint: str, rdzv_secret_file: Path
) -> None:
    with _members(_member_env(etcd_endpoint, rdzv_secret_file)) as procs:
        procs[1].kill()
        procs[1].wait(timeout=10)
        os.kill(procs[3].pid, signal.SIGSTOP)
        _wait_until_stopped(procs[3].pid)
        members = ["node0", "node2"]
        assert _ask([procs[0], procs[2]]) == [
            {"generation": 1, "rank": 0, "members": members},
            {"generation": 1, "rank": 1, "members": members},
        ]
        os.kill(procs[3].pid, signal.SIGCONT)
        fenced = _ask(procs[3:])[0]
        assert "fenced out of generation 1" in fenced["fenced"], fenced


def test_a_member_late_to_a_generation_joins_the_one_the_others_went_on_to(
    etcd_endpoint: str, rdzv_secret_file: Path
) -> None:
    """Three members agree twice (they gave up on generation 1, which waited for the
    fourth); the fourth, late, comes to generation 2 with them, not to 1 alone. Once
    the others go on without it (it stopped), it is fenced out by the newest."""
    with _members(_member_env(etcd_endpoint, rdzv_secret_file)) as procs:
        everyone = ["node0", "node1", "node2", "node3"]
        for generation in (1, 2):
            answers = _ask(procs[:3])
            assert [(a["generation"], a["members"]) for a in answers] == [
                (generation, everyone)
            ] * 3
        assert _ask(procs[3:]) == [{"generation": 2, "rank": 3, "members": everyone}]
        os.kill(procs[3].pid, signal.SIGSTOP)
        _wait_until_stopped(procs[3].pid)
        for generation in (3, 4):  # without it; then once more, with only the three
            answers = _ask(procs[:3])
            assert [(a["generation"], a["members"]) for a in answers] == [
                (generation, everyone[:3])
            ] * 3
        os.kill(procs[3].pid, signal.SIGCONT)
        fenced = _ask(procs[3:])[0]
        assert "fenced out of generation 4" in fenced["fenced"], fenced


# -- leaving a group ----------------------------------------------------------------


def _gloo_sockets() -> int:
    return sum(c.status == psutil.CONN_ESTABLISHED for c in psutil.Process().net_connections("tcp"))


def _abort_and_count(rank: int, store_file: str, planned: bool, out: str) -> None:
    """One of two ranks: form a gloo group on a file store (no socket of its own),
    leave it with :func:`abort_group`, record the sockets open at the return and
    how long the last of them took to close."""
    dist.init_process_group("gloo", store=dist.FileStore(store_file, 2), rank=rank, world_size=2)
    dist.barrier()
    opened = _gloo_sockets()
    trainer = SimpleNamespace(ctx=SimpleNamespace(backend="gloo"), ddp=object())
    abort_group(trainer, planned=planned)  # type: ignore[arg-type]
    at_return, started = _gloo_sockets(), time.monotonic()
    while _gloo_sockets() and time.monotonic() - started < 10:
        time.sleep(0.01)
    record = {"opened": opened, "at_return": at_return, "left": _gloo_sockets(),
              "initialized": dist.is_initialized(), "ddp": hasattr(trainer, "ddp")}  # fmt: skip
    Path(out, f"{rank}.json").write_text(json.dumps(record))


@pytest.mark.parametrize("planned", [False, True], ids=["failure", "planned"])
def test_leaving_a_group_closes_its_sockets_at_once_after_a_failure_and_soon_when_planned(
    tmp_path: Path, planned: bool
) -> None:
    # After a failure the closed sockets are what wakes a survivor blocked in a
    # receive from this rank, so they close before abort_group returns. In a
    # planned regroup nobody waits, and the group's destructor (20-30 ms) runs
    # in a thread; the group must still go, not linger as a leak.
    store_file = str(tmp_path / "store")
    start_workers(_abort_and_count, args=(store_file, planned, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"{rank}.json").read_text())
        assert record["opened"] >= 1, record  # the pair to the other rank
        assert not record["initialized"] and not record["ddp"], record
        assert record["left"] == 0, record
        if not planned:
            assert record["at_return"] == 0, record


# -- end to end -------------------------------------------------------------------


def _run_local(
    run_dir: Path, *args: str, nodes: int = 3, chaos: str = "kill:1@step6,kill:rank0@step14"
) -> tuple[dict, str]:
    """The run's summary and the runner's own log. The forwards pause 0.1 s until
    the faults are over: a world of 1 trains."""
    pace = Pace(run_dir.parent / f"{run_dir.name}-pause", 0.1)
    tail = AuditTail(run_dir / "audit")

    def tick() -> None:
        if any(isinstance(r, StepRecord) and r.world_size == 1 for r in tail.poll()):
            pace.set(0.0)

    command = [
        "--nodes", str(nodes), "--min-nodes", "1", "--chaos", chaos,
        "--run-dir", str(run_dir), "--timeout", "240", "--metrics-port", "0",
        # The first round waits for all 3 agents: with the default 1 s last call and
        # --min-nodes 1, an agent late on a loaded machine made a round of 2, then its
        # arrival restarted everyone (5 worker processes, not 3). A round of 3 (--nnodes'
        # maximum) closes at once, and in-process recovery forms no more rounds.
        "--rdzv-conf", "last_call_timeout=20", f"--model.options.pause_file={pace.path}",
        *args,
    ]  # fmt: skip
    # nodes=0: no world of 0 trains, so run_steered's own rejoin watch never ends the pause
    summary = run_steered(run_dir, command, pace=pace, nodes=0, on_tick=tick)
    return summary, (run_dir.parent / f"{run_dir.name}-local.stderr").read_text()


@needs_inprocess
@pytest.mark.slow
def test_survivors_keep_their_processes_through_a_kill_and_a_rank0_kill(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    # "auto" (test_recovery_mode): in process, because our plugin and a secret are there.
    summary, runner_log = _run_local(run_dir, *TRAINER_ARGS, "--elastic.recovery=auto")
    assert summary["completed"], summary
    for node in ("node0", "node1", "node2"):
        modes = log_events(run_dir / "logs" / f"{node}.log", "recovery_mode")
        assert [(e["requested"], e["mode"]) for e in modes] == [("auto", "inprocess")], modes
    assert summary["final_step"] == STEPS
    assert summary["exactly_once"], summary["exactly_once_detail"]
    recoveries = summary["recoveries"]
    assert [(r["kind"], r["node"], r["world_size_after"]) for r in recoveries] == [
        ("kill", 1, 2),
        ("kill", 0, 1),
    ]
    for recovery in recoveries:
        assert recovery["restore_source"] == "inprocess", recovery
        assert 0 <= recovery["lost_steps"] <= 1, recovery
    # Audit files are per process: node 2's one worker wrote all three starts,
    # so it was never restarted; node 0's saw the first re-form before it died.
    resumes = resumes_by_process(run_dir)
    by_node = {name.split("-")[1]: starts for name, starts in resumes.items()}
    assert len(resumes) == 3, resumes
    assert by_node["node2"][1:] == [("inprocess", 2), ("inprocess", 1)]
    assert by_node["node0"][1:] == [("inprocess", 2)]
    assert by_node["node1"][1:] == []
    # torchrun's exit barrier waits for all 3 agents of the round: the final rank 0
    # arrived for the 2 that left, so node 2's agent exited 0 by itself (one still
    # waiting when the runner's FINISH_GRACE_S ran out would have been terminated).
    assert summary["nodes"]["node2"] == "exited(0)", summary["nodes"]
    assert "local_nodes_left_after_finish" not in runner_log
    released = log_events(run_dir / "logs" / "node2.log", "exit_barrier_released")
    assert [(e["agents"], e["present"], e["departed"]) for e in released] == [(3, 1, 2)]
    # The reference: one process (forked), no torchrun, no faults, no pause file.
    assert_ends_like(summary, run_dir, tmp_path / "reference", TRAINER_ARGS)


@needs_inprocess
@pytest.mark.slow
def test_a_kill_during_an_evaluation_re_forms_the_group_and_evaluates_again(
    tmp_path: Path,
) -> None:
    """Evaluation runs collectives between steps: a peer killed during one is a failure
    like one inside a step. The survivor re-forms at world 1 in the same process and
    evaluates the step again; nothing is rolled back (no step was in flight)."""
    run_dir = tmp_path / "run"
    # 24 evaluation batches of 4 (12 a rank), each forward paused 0.1 s: the evaluation
    # after step 10 lasts over a second, and the kill 0.4 s after step 10 lands inside
    # it. A rank records a step before its gradient all-reduce: without the delay, a
    # kill sent within milliseconds of the records landed in the step's all-reduce
    # (once, beside another test). Step 10 is neither a save (every 4) nor an epoch's
    # end (every 6): a save's collectives come between a step and the evaluation.
    eval_args = ["--eval.every_steps=10", "--eval.batch_size=4"]
    summary, _ = _run_local(run_dir, *TRAINER_ARGS, *eval_args, nodes=2, chaos="kill:1@step10+0.4s")
    assert summary["completed"] and summary["final_step"] == STEPS, summary
    assert summary["exactly_once"], summary["exactly_once_detail"]
    node0 = run_dir / "logs" / "node0.log"
    (started,) = log_events(node0, "inprocess_recovery_started")
    assert started["error"].startswith("evaluation: "), started
    (recovered,) = log_events(node0, "inprocess_recovered")
    assert (recovered["step"], recovered["world_size"], recovered["lost_steps"]) == (10, 1, 0)
    evaluations = [(e["step"], e["world_size"]) for e in log_events(node0, "evaluation")]
    assert evaluations[0] == (10, 1), evaluations  # the evaluation at step 10, done again
    starts = {name.split("-")[1]: s for name, s in resumes_by_process(run_dir).items()}
    assert starts["node0"][1:] == [("inprocess", 1)], starts  # one process, never restarted
    assert_ends_like(summary, run_dir, tmp_path / "reference", [*TRAINER_ARGS, *eval_args])


@needs_inprocess
@pytest.mark.slow
def test_a_preempted_node_leaves_and_the_others_stay_in_their_processes(tmp_path: Path) -> None:
    """SIGTERM to node 1 of 3 (a preemption), in process: every rank stops after the
    same step, node 1 leaves without a save, nodes 0 and 2 re-form without it in the
    processes they started with and lose no step; node 1 then comes back and is
    admitted while they train."""
    run_dir = tmp_path / "run"
    # 0.2 s steps until all 3 train again: the 108 steps after the join leave the
    # new node over 20 s to start, on any machine.
    pace = Pace(tmp_path / "pause", 0.2)
    steps = 120
    args = [a for a in TRAINER_ARGS if not a.startswith("--training.steps=")]
    args.append(f"--training.steps={steps}")
    command = [
        "--nodes", "3", "--min-nodes", "1", "--chaos", "term:1@step6,join:1@step12",
        "--run-dir", str(run_dir), "--timeout", "240", "--metrics-port", "0",
        "--rdzv-conf", "last_call_timeout=20", f"--model.options.pause_file={pace.path}",
        *args,
    ]  # fmt: skip
    summary = run_steered(run_dir, command, pace=pace, nodes=3)
    assert summary["completed"] and summary["final_step"] == steps, summary
    assert summary["exactly_once"], summary["exactly_once_detail"]
    term, join = summary["recoveries"]
    assert (term["kind"], term["world_size_after"], term["lost_steps"]) == ("term", 2, 0), term
    assert (join["kind"], join["world_size_after"]) == ("join", 3), join
    logs = {node: run_dir / "logs" / f"{node}.log" for node in ("node0", "node1", "node2")}
    (left,) = log_events(logs["node1"], "worker_exit_after_preemption")
    assert (left["reason"], left["exit_code"]) == ("preempted", 0), left
    assert len(log_events(logs["node1"], "inprocess_leaving")) == 1
    for node in ("node0", "node2"):
        (shrunk,) = log_events(logs[node], "inprocess_shrunk_after_preemption")
        assert shrunk["world_size"] == 2, shrunk
        assert not log_events(logs[node], "worker_exit_after_preemption"), node
    starts = {name.split("-")[1]: s for name, s in resumes_by_process(run_dir).items()}
    for node in ("node0", "node2"):  # one process each, through both changes
        assert starts[node][1:] == [("inprocess", 2), ("inprocess", 3)], starts
    assert_ends_like(summary, run_dir, tmp_path / "reference", args)
