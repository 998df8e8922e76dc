"""Chaos tests: real torchrun agents, real etcd, real signals (issue 4).

Every scenario drives a :class:`LocalCluster` step by step: an action fires
once the audited training has reached a step, so the tests do not depend on how
fast a shared machine is. Each asserts that training completed, that the audit
found every sample exactly once per epoch, that the final parameters are close
to a fault-free run, and that the logs name what happened.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from chaos_runs import log_events
from torch_support import needs_inprocess
from trainer_procs import run_workers

from elastic_train.agent.zygote import trainer_processes
from elastic_train.audit import RESULT_FILE, AuditTail, StepRecord
from elastic_train.errors import EXIT_HANG
from elastic_train.etcd.server import EtcdCluster, EtcdServer
from elastic_train.local.chaos import ChaosEvent
from elastic_train.local.cluster import ClusterSpec, LocalCluster
from elastic_train.local.runner import Delivery, Summary, summarize

TESTS_DIR = Path(__file__).resolve().parent
JOB = (
    "model.name=chaos_model:slow_mlp",
    "model.hidden_size=128",  # a checkpoint of ~200 KB, for the disk-full limit
    "model.num_layers=2",
    "data.name=synthetic",
    "data.num_samples=256",
    "data.num_features=8",
    "data.num_classes=4",
    "training.global_batch_size=16",
    "training.micro_batch_size=0",
    "training.final_loss_samples=256",
    "optimizer.lr=0.01",
    "schedule.name=constant",
    "schedule.warmup_steps=3",
    "checkpoint.interval_steps=10",
    "logging.format=json",
    "logging.log_every_steps=50",
)
#: summation order changes with the world size; everything else is replayed exactly
PARAM_ATOL = 1e-4
_references: dict[int, dict[str, torch.Tensor]] = {}


def reference_params(steps: int, tmp_root: Path) -> dict[str, torch.Tensor]:
    """The fault-free result: one process without the pause (the trainer is world-size
    invariant and the pause changes no number)."""
    if steps not in _references:
        audit = tmp_root / f"reference-{steps}"
        overrides = [*JOB, f"training.steps={steps}", "model.options.pause_s=0",
                     "checkpoint.dir=", f"logging.audit_dir={audit}"]  # fmt: skip
        run_workers(1, overrides)
        _references[steps] = torch.load(audit / "final_params.pt", weights_only=True)
    return _references[steps]


class Scenario:
    """One cluster run with a scripted sequence of faults; ``run()`` audits it."""

    def __init__(
        self,
        run_dir: Path,
        *,
        steps: int,
        nodes: int = 2,
        args: tuple[str, ...] = (),
        rdzv_endpoint: str | None = None,
        timeout_s: float = 240.0,
        exit_wait_s: float = 20.0,
        grace_s: float = 5.0,
    ) -> None:
        pythonpath = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
        self.pause_file = run_dir.parent / f"{run_dir.name}-pause"
        self.set_pause(0.05)
        job = (*JOB, f"model.options.pause_file={self.pause_file}", f"training.steps={steps}",
               *args)  # fmt: skip
        self.spec = ClusterSpec(
            nodes=nodes, script_args=tuple(f"--{o}" for o in job), rdzv_endpoint=rdzv_endpoint,
            env=(("PYTHONPATH", pythonpath),), metrics_port=None, timeout_s=timeout_s,
            grace_s=grace_s,
        )  # fmt: skip
        self.steps = steps
        self.exit_wait_s = exit_wait_s  # after the end of training, for the nodes to exit
        self.run_dir = run_dir
        self.cluster = LocalCluster(self.spec, run_dir=run_dir)
        self.deliveries: list[Delivery] = []
        self.step = 0
        self.world_size = 0  # of the latest step record
        self._tail = AuditTail(self.cluster.audit_dir)
        self._started = time.monotonic()

    def set_pause(self, seconds: float) -> None:
        """Seconds each forward pass sleeps from now on (in every worker)."""
        partial = self.pause_file.with_suffix(".tmp")
        partial.write_text(str(seconds))
        os.replace(partial, self.pause_file)

    def finish_fast(self) -> None:
        """The faults are over: let the remaining steps run at full speed."""
        self.set_pause(0.0)

    def deliver(self, kind: str, node: int) -> float:
        """A chaos event now, as the runner delivers it; returns its wall time."""
        event = ChaosEvent(kind, node, at_seconds=0)  # type: ignore[arg-type]
        deadline = time.monotonic() + 60
        while True:
            now, elapsed = time.time(), time.monotonic() - self._started
            outcome = self.cluster.deliver(event)
            if outcome is not None or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # e.g. a join while the terminated agent still shuts down
        assert outcome == "delivered", f"{event}: {outcome}"
        self.deliveries.append(
            Delivery(event=event, node=node, time=now, elapsed=elapsed, outcome=outcome)
        )
        return now

    def observe(self) -> int:
        for record in self._tail.poll():
            if isinstance(record, StepRecord):
                self.step = max(self.step, record.step)
                self.world_size = record.world_size
        self.cluster.poll()
        return self.step

    def wait_for_recovery(self, *, world_size: int, timeout: float = 120.0) -> None:
        """Until a step beyond the current one ran at ``world_size``."""
        step = self.step
        self.wait_until(
            lambda: self.observe() > step and self.world_size == world_size,
            what=f"a step at world size {world_size}", timeout=timeout,
        )  # fmt: skip

    def wait_for_step(self, step: int, *, timeout: float = 90.0) -> None:
        self.wait_until(lambda: self.observe() >= step, what=f"step {step}", timeout=timeout)

    def wait_until(self, ok: Callable[[], object], *, what: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            assert time.monotonic() < deadline, f"{what} not reached; at step {self.step}"
            self.observe()
            time.sleep(0.05)

    def run(self, script: Callable[[Scenario], None]) -> Summary:
        """Start the nodes, run ``script`` (the faults), then wait for the end."""
        result = self.cluster.audit_dir / RESULT_FILE
        with self.cluster:
            script(self)
            self.wait_until(
                lambda: result.exists() or not self.cluster.alive_nodes(),
                what="the end of training", timeout=self.spec.timeout_s,
            )  # fmt: skip
            deadline = time.monotonic() + self.exit_wait_s
            while self.cluster.alive_nodes() and time.monotonic() < deadline:
                time.sleep(0.1)
        return summarize(
            self.cluster, self.deliveries, error=None,
            wall_seconds=time.monotonic() - self._started,
        )  # fmt: skip

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in (self.run_dir / "logs").glob("*"))

    def assert_good_run(self, summary: Summary, tmp_root: Path) -> None:
        assert summary.completed, summary.to_json()
        assert summary.final_step == self.steps
        assert summary.exactly_once, summary.exactly_once_detail
        params = torch.load(self.run_dir / "audit" / "final_params.pt", weights_only=True)
        for name, value in reference_params(self.steps, tmp_root).items():
            torch.testing.assert_close(params[name], value, atol=PARAM_ATOL, rtol=0)


# -- preemption and etcd outages -----------------------------------------------------


#: seconds etcd is down
OUTAGE_S = 10.0


def _end_the_outage(s: Scenario, etcd: EtcdServer) -> int:
    """Keep etcd down for OUTAGE_S from now, then start it on its kept data dir; the
    step reached without it."""
    down_until = time.monotonic() + OUTAGE_S
    s.wait_until(lambda: time.monotonic() >= down_until, what="the outage", timeout=30)
    step = s.observe()
    etcd.start()
    return step


def _run_on(
    etcd: EtcdServer, tmp_path: Path, *, steps: int, script: Callable[[Scenario], None]
) -> tuple[Scenario, Summary]:
    """Two nodes on ``etcd`` through ``script``, checked against a fault-free run."""
    try:
        scenario = Scenario(tmp_path / "run", steps=steps, rdzv_endpoint=etcd.endpoint)
        summary = scenario.run(script)
    finally:
        etcd.stop()
    scenario.assert_good_run(summary, tmp_path)
    return scenario, summary


@pytest.mark.slow
def test_etcd_outage_and_restart_then_sigterm_and_rejoin(tmp_path: Path) -> None:
    """etcd down 10 s mid-training, restarted on its data dir; then a node is
    preempted (zero lost steps) and rejoins, both rounds on the restarted etcd.
    10 s outlasts every client bound the agents have (dial and read timeouts, 5 s
    each; keep-alive pruning, 3 s); only the lease TTL (hours) is longer."""
    etcd = EtcdServer(data_dir=tmp_path / "etcd" / "data", name="outage").start()
    outage: dict[str, int] = {}

    def script(s: Scenario) -> None:
        s.wait_for_step(10)
        s.set_pause(0.2)  # at most ~50 steps during the outage, whatever the machine
        etcd.stop()  # SIGTERM; the data dir stays
        outage["start"] = s.step
        outage["end"] = _end_the_outage(s, etcd)
        # The outage used up to ~60 of the 180 steps; a slower pace leaves the rest
        # ~60 s for the preemption and the rejoin, even on a loaded 2-core machine.
        s.set_pause(0.5)
        s.wait_for_step(outage["end"] + 5)
        s.deliver("term", 1)
        s.wait_for_recovery(world_size=1)
        s.wait_for_step(s.step + 5)  # node0 trains alone
        s.deliver("join", 1)
        s.wait_for_recovery(world_size=2)
        s.finish_fast()

    scenario, summary = _run_on(etcd, tmp_path, steps=180, script=script)
    # training went on without etcd (a step takes 0.2 s and its arithmetic)
    assert outage["end"] - outage["start"] >= 20, outage
    term, join = summary.recoveries
    assert term.lost_steps == 0, summary.to_json()
    assert term.world_size_after == 1 and term.restore_source is not None
    assert join.world_size_after == 2  # the preempted node is back in the group
    logs = scenario.logs()
    assert '"preemption_stop"' in logs and '"reason": "preempted"' in logs
    assert '"reason": "peer_preempted"' in logs and "worker_exit_after_preemption" in logs
    assert "rendezvous_etcd_unreachable" in logs  # the agents noticed the outage, and rode it out


@needs_inprocess
@pytest.mark.slow
def test_a_kill_during_an_etcd_outage_falls_back_to_the_restart_path(tmp_path: Path) -> None:
    """In process (the default), a node is killed while etcd is down: the survivor
    cannot agree a new group without etcd, so it takes the restart path, whose
    rendezvous waits out the outage; then the killed node rejoins. Every sample
    once, and the fault-free run's parameters."""
    etcd = EtcdServer(data_dir=tmp_path / "etcd" / "data", name="outage-kill").start()

    def script(s: Scenario) -> None:
        s.wait_for_step(10)
        s.set_pause(0.2)
        etcd.stop()
        s.wait_for_step(s.step + 3)  # training goes on without etcd
        s.deliver("kill", 1)
        _end_the_outage(s, etcd)
        s.wait_for_recovery(world_size=1)
        s.deliver("join", 1)
        s.wait_for_recovery(world_size=2)
        s.finish_fast()

    scenario, summary = _run_on(etcd, tmp_path, steps=150, script=script)
    kill, join = summary.recoveries
    assert kill.world_size_after == 1 and join.world_size_after == 2, summary.to_json()
    assert kill.restore_source not in (None, "inprocess"), summary.to_json()  # the restart path
    assert kill.lost_steps is not None and kill.lost_steps <= 1, summary.to_json()  # a snapshot
    logs = scenario.logs()
    assert '"inprocess_recovery_failed"' in logs and '"fallback": "restart"' in logs


# -- a hung worker, on a 3-member etcd cluster that loses its leader twice -------------


@pytest.mark.slow
def test_hung_worker_is_detected_while_etcd_loses_its_leader(tmp_path: Path) -> None:
    """The etcd leader dies during training (and comes back), a worker is
    SIGSTOPped, the survivor's watchdog ends its blocked collective, and the
    leader dies again during the rendezvous that follows (the restart path: in
    process, a step timeout ends the collective first, tests/test_inprocess_faults.py)."""
    etcd = _etcd_cluster(tmp_path / "etcd").start()
    killed: list[str] = []

    def kill_leader() -> None:
        leader = etcd.leader()
        leader.kill()
        killed.append(leader.name)
        etcd.leader()  # a new one is elected (raises if not within 10 s)
        leader.start()  # back on its data dir: three members again

    def hang_logged() -> bool:
        return "worker_hang_detected" in (scenario.run_dir / "logs" / "node0.log").read_text()

    def script(s: Scenario) -> None:
        s.wait_for_step(10)
        kill_leader()
        s.wait_for_step(s.step + 10)
        s.deliver("stop", 1)
        # Slow steps keep the faults mid-run while node1's agent waits out
        # torchrun's 30 s SIGTERM->SIGKILL on its stopped worker.
        s.set_pause(1.0)
        s.wait_until(hang_logged, what="the watchdog on node0", timeout=60)
        kill_leader()  # during the rendezvous that re-forms the group
        # The group re-forms and trains again. Whether node1 is back in it by
        # then depends on that 30 s wait and on etcd's election, so any world
        # size counts here; the audit below still demands exactly-once data.
        s.wait_for_step(s.step + 1, timeout=120)
        s.finish_fast()

    # exit_wait_s: node1's agent may still wait out torchrun's 30 s SIGTERM->SIGKILL on
    # its stopped worker when training ends; nothing below needs it gone (node0 logs
    # the hang, the exit code and the failover), and leaving the cluster kills it.
    # 2 s is for node0, which exits at once; the rest of the wait would be node1's.
    # grace_s: node1's agent answers the cluster's SIGTERM with that wait too, and
    # would hold the cluster's exit for the whole grace before its SIGKILL.
    scenario = Scenario(
        tmp_path / "run", steps=120, rdzv_endpoint=etcd.endpoints, exit_wait_s=2.0, grace_s=1.0,
        args=("elastic.watchdog_floor_seconds=3", "elastic.watchdog_multiple=5",
              "elastic.pg_timeout_seconds=120", "elastic.recovery=restart"),
    )  # fmt: skip
    try:
        summary = scenario.run(script)
    finally:
        etcd.stop()
    scenario.assert_good_run(summary, tmp_path)
    assert len(killed) == 2
    (stop,) = summary.recoveries
    assert stop.seconds is not None
    print(f"hang-to-recovery seconds: {stop.seconds:.1f}")
    logs = scenario.logs()
    assert '"worker_hang_detected"' in logs and "Thread" in logs  # the event and the stack dump
    assert f"exitcode: {EXIT_HANG}" in logs
    assert "etcd_failover" in logs  # the clients moved to another member


@needs_inprocess
@pytest.mark.slow
def test_a_kill_while_etcd_elects_a_leader_recovers_in_process(tmp_path: Path) -> None:
    """In process (the default), the survivors of a kill agree on their next group
    in etcd. The etcd leader is killed, then node 2 at once: that agreement runs
    while the etcd cluster elects a new leader, and the survivors still re-form
    in place, each in the process it started with."""
    etcd = _etcd_cluster(tmp_path / "etcd").start()

    def script(s: Scenario) -> None:
        s.wait_for_step(10)
        leader = etcd.leader()
        leader.kill()
        s.deliver("kill", 2)
        s.wait_for_recovery(world_size=2)
        etcd.leader()  # elected meanwhile (raises if not within 10 s)
        leader.start()
        s.wait_for_step(s.step + 5)
        s.finish_fast()

    scenario = Scenario(tmp_path / "run", steps=60, nodes=3, rdzv_endpoint=etcd.endpoints)
    try:
        summary = scenario.run(script)
    finally:
        etcd.stop()
    scenario.assert_good_run(summary, tmp_path)
    (kill,) = summary.recoveries
    assert kill.restore_source == "inprocess" and kill.lost_steps is not None, kill
    assert kill.lost_steps <= 1, kill
    for node in ("node0", "node1"):
        log = scenario.run_dir / "logs" / f"{node}.log"
        assert len(log_events(log, "inprocess_recovered")) == 1, node
        assert len(log_events(log, "resumed")) == 1, node  # started once, never restarted
    print(f"kill-to-step seconds while etcd elected a leader: {kill.seconds:.2f}")


# -- storage: a full disk, then a corrupt latest checkpoint ---------------------------------


def _etcd_cluster(root: Path) -> EtcdCluster:
    # free_port() can hand out one port twice (it is free until someone binds it):
    # draw again until the six ports differ.
    while True:
        cluster = EtcdCluster(root, size=3)
        ports = [p for m in cluster.members for p in (m.client_port, m.peer_port)]
        if len(set(ports)) == len(ports):
            return cluster


def _worker_of(cluster: LocalCluster, node: int) -> psutil.Process:
    agent = psutil.Process(cluster.nodes[node].proc.pid)
    (worker,) = trainer_processes(agent)  # the zygote's child where started warm
    return worker


@pytest.mark.slow
def test_disk_full_then_corrupt_latest_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    failures = '"checkpoint_write_failed"'
    window: dict[str, int] = {}

    def script(s: Scenario) -> None:
        s.wait_until(lambda: _complete_steps(run_dir)[-1] > 0, what="a first checkpoint")
        worker = _worker_of(s.cluster, 0)
        # Every file this worker writes stays below the limit, except a checkpoint.
        written = [p for d in ("logs", "audit") for p in (run_dir / d).rglob("*") if p.is_file()]
        limit = max(p.stat().st_size for p in written) + 64 * 1024
        checkpoint = next((run_dir / "checkpoints").glob("step-*/state.pt"))
        assert checkpoint.stat().st_size > limit, "the limit would not stop a checkpoint"
        resource.prlimit(worker.pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        window["start"] = s.step
        s.wait_until(lambda: s.logs().count(failures) >= 2, what="two failed saves")
        resource.prlimit(worker.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        window["end"] = s.step
        s.wait_until(lambda: _complete_steps(run_dir)[-1] > window["end"], what="a save")
        s.deliver("kill", 0)
        latest = _complete_steps(run_dir)[-1]
        window["corrupted"] = latest
        state = run_dir / "checkpoints" / f"step-{latest:09d}" / "state.pt"
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))
        s.deliver("join", 0)
        s.wait_for_recovery(world_size=1)
        s.finish_fast()

    # Disk checkpoints only: a shared-memory snapshot would outlive the kill and
    # be restored instead of the corrupted checkpoint.
    scenario = Scenario(run_dir, steps=100, nodes=1, args=("elastic.snapshot=false",))
    summary = scenario.run(script)
    scenario.assert_good_run(summary, tmp_path)
    logs = scenario.logs()
    assert "File too large" in logs  # EFBIG from the limit, named in the failure event
    assert '"checkpoint_fallback"' in logs  # the corrupt one was skipped, not loaded
    _, rejoin = summary.recoveries
    assert rejoin.restored_step is not None and rejoin.restored_step < window["corrupted"]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # no partial save left behind


def _complete_steps(run_dir: Path) -> list[int]:
    return sorted(
        int(p.parent.name.split("-")[1])
        for p in (run_dir / "checkpoints").glob("step-*/MANIFEST.json")
    ) or [0]
