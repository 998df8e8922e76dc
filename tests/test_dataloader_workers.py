"""DataLoader workers under the elastic sampler (``data.num_workers`` and friends).

What must hold: the keys are checked up front; the workers load exactly the
micro-batches the steps take (the same weights as loading in the training
process); what they loaded for steps that never completed does not count
(the exactly-once audit and the weights of a resized run with kills and
joins); and no worker outlives its trainer.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from loader_data import loaded_indices, loader_workers, orphaned
from steered_runs import JOIN_WAIT_S, Pace, forked_reference, run_steered
from torch.utils.data import Dataset, IterableDataset
from workers import run_main

from elastic_train.config.args import parse_cli
from elastic_train.config.job import DataConfig, JobConfig, TrainingConfig, fingerprint
from elastic_train.errors import ConfigError
from elastic_train.local.cluster import MAIN_SCRIPT
from elastic_train.training.batches import BatchLoader
from elastic_train.training.loader import StepPlan
from elastic_train.training.sampler import ElasticSampler
from elastic_train.training.step import step_chunks
from elastic_train.workload.datasets import DataBundle, PositionalStream, stream_items
from elastic_train.workload.registry import DATASETS

#: One intra-op thread: several trainers share 2 cores, where OpenMP threads spin.
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
CPU = torch.device("cpu")


def wait_for(predicate: Callable[[], object], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# -- the keys ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--data.num_workers=-1"], "data.num_workers = -1: must be >= 0"),
        (["--data.prefetch_factor=4"], "data.prefetch_factor = 4: needs data.num_workers > 0"),
        (["--data.persistent_workers=true"], "data.persistent_workers = True: needs data.num_w"),
        (["--data.num_workers=2", "--data.prefetch_factor=-1"], "data.prefetch_factor = -1: mu"),
        (["--data.pin_memory=maybe"], "data.pin_memory"),
        (["--data.num_workers=two"], "data.num_workers"),
    ],
)
def test_loader_keys_are_refused_naming_the_key_and_what_it_accepts(
    overrides: list[str], expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_cli(overrides)
    assert expected in str(info.value)
    cfg = parse_cli(
        [
            "--data.num_workers=2",
            "--data.prefetch_factor=4",
            "--data.persistent_workers=true",
            "--data.pin_memory=false",
        ]
    ).config
    assert (cfg.data.num_workers, cfg.data.prefetch_factor) == (2, 4)
    assert cfg.data.persistent_workers and not cfg.data.pin_memory


def test_how_data_is_loaded_is_not_part_of_the_checkpoint_fingerprint() -> None:
    cfg = JobConfig()
    loading = DataConfig(num_workers=3, prefetch_factor=5, persistent_workers=True,
                         pin_memory=False)  # fmt: skip
    assert fingerprint(dataclasses.replace(cfg, data=loading)) == fingerprint(cfg)
    other_data = dataclasses.replace(cfg, data=DataConfig(num_samples=7))
    assert fingerprint(other_data) != fingerprint(cfg)  # what is loaded still counts


# -- the plan ---------------------------------------------------------------------


def _steps_take(
    sampler: ElasticSampler,
    *,
    rank: int,
    world: int,
    mbs: int,
    steps: int,
    epochs: int,
    step: int,
    first_ranks: int | None = None,
) -> list[tuple[int, tuple[int, ...]]]:
    """The (epoch, indices) of each micro-batch the loop's steps load, as run_step goes
    (``first_ranks``: the members that split the first step's batch while joiners heal)."""
    keys = []
    ranks = world if first_ranks is None else first_ranks
    while (step < steps) if steps else (sampler.epoch < epochs):
        epoch, batch = sampler.epoch, sampler.next_global_batch()
        shard = ElasticSampler.shard(batch, rank, ranks) if rank < ranks else []
        ranks = world
        keys += [(epoch, tuple(c)) for c in step_chunks(batch, shard, mbs)[0]]
        step += 1
        if sampler.epoch_finished():
            sampler.start_next_epoch()
    return keys


@pytest.mark.parametrize("world", [1, 2, 3, 7])
@pytest.mark.parametrize("mbs", [0, 3])
@pytest.mark.parametrize(("steps", "epochs"), [(14, 0), (0, 3)])
def test_the_plan_is_what_the_steps_take_from_a_restored_position(
    world: int, mbs: int, steps: int, epochs: int
) -> None:
    # 23 samples in global batches of 5: a short last batch, and empty shards at world 7.
    sampler = ElasticSampler(23, global_batch_size=5, seed=4)
    sampler.load_state_dict({"seed": 4, "epoch": 0, "samples_consumed": 10})  # mid-epoch resume
    for rank in range(world):
        plan = StepPlan(sampler.copy(), rank=rank, world_size=world, micro_batch_size=mbs,
                        step=2, until_step=steps, until_epoch=epochs)  # fmt: skip
        planned = []
        while not plan.done():  # one iterator per epoch, as the DataLoader draws them
            planned += list(iter(plan))
        taken = _steps_take(sampler.copy(), rank=rank, world=world, mbs=mbs, steps=steps,
                            epochs=epochs, step=2)  # fmt: skip
        assert planned == taken
        assert list(iter(plan)) == []  # nothing beyond the run's end
    assert sampler.state_dict()["samples_consumed"] == 10  # the real sampler never moved


@pytest.mark.parametrize("mbs", [0, 2])
def test_the_plan_of_a_heal_step_gives_the_members_the_batch_and_a_joiner_one_weightless_sample(
    mbs: int,
) -> None:
    sampler = ElasticSampler(23, global_batch_size=5, seed=4)
    sampler.load_state_dict({"seed": 4, "epoch": 0, "samples_consumed": 10})
    first = sampler.copy().next_global_batch()
    for rank in range(3):  # ranks 0 and 1 hold the state, rank 2 joined
        plan = StepPlan(sampler.copy(), rank=rank, world_size=3, micro_batch_size=mbs,
                        step=2, until_step=6, until_epoch=0, first_ranks=2)  # fmt: skip
        planned = []
        while not plan.done():  # one iterator per epoch, as the DataLoader draws them
            planned += list(iter(plan))
        taken = _steps_take(sampler.copy(), rank=rank, world=3, mbs=mbs, steps=6, epochs=0,
                            step=2, first_ranks=2)  # fmt: skip
        assert planned == taken
        # The first step: the members' shares of the batch between two, and the
        # joiner's zero-weight first sample (step_chunks).
        share = ElasticSampler.shard(first, rank, 2) if rank < 2 else []
        chunks, weight = step_chunks(first, share, mbs)
        assert planned[: len(chunks)] == [(0, tuple(c)) for c in chunks]
        assert (weight, chunks) == ((0.0, [first[:1]]) if rank == 2 else (1.0, chunks))


# -- in one process -----------------------------------------------------------------


class Uneven(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Items 0..bad-1 have 4 features, the rest 3: batches past ``bad`` cannot be stacked."""

    def __init__(self, size: int, bad: int) -> None:
        self.size, self.bad = size, bad

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = 4 if index < self.bad else 3
        return torch.full((width,), float(index)), torch.tensor(index)


def _started(data: Dataset[Any], **loader: Any) -> tuple[BatchLoader, ElasticSampler]:
    bundle = DataBundle(data, {})
    batches = BatchLoader(bundle, DataConfig(num_workers=1, **loader), device=CPU)
    sampler = ElasticSampler(len(bundle), global_batch_size=4, seed=0, shuffle=False)
    batches.start(sampler, step=0, rank=0, world_size=1,
                  training=TrainingConfig(steps=6, micro_batch_size=2))  # fmt: skip
    return batches, sampler


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_a_batch_the_collate_function_cannot_handle_in_a_worker_names_the_key() -> None:
    before = _children()
    batches, sampler = _started(Uneven(24, bad=9))
    try:
        with pytest.raises(ConfigError) as info:
            for _ in range(6):
                batch = sampler.next_global_batch()
                for chunk in step_chunks(batch, batch, 2)[0]:
                    _, target = batches.for_step(chunk, epoch=0)
                    assert target.tolist() == chunk  # the loaded batch is the one asked for
        text = str(info.value)
        assert "data.collate_fn = '' (torch's default_collate): cannot make a batch" in text
        assert "indices [8, 9]" in text and "DataLoader worker" in text
    finally:
        batches.close()
    wait_for(lambda: _children() <= before, timeout=10, what="the loader workers to exit")


def test_workers_out_of_step_stop_and_the_batch_loads_here() -> None:
    before = _children()
    batches, sampler = _started(Uneven(24, bad=24), persistent_workers=True)
    sampler.next_global_batch()  # a step the plan does not know about (not one the loop makes)
    batch = sampler.next_global_batch()
    _, target = batches.for_step(batch[:2], epoch=0)
    assert target.tolist() == batch[:2] == [4, 5]  # loaded here, not the workers' [0, 1]
    assert batches._prefetcher is None  # the workers were stopped...
    wait_for(lambda: _children() <= before, timeout=10, what="the loader workers to exit")
    _, target = batches.for_step(batch[2:], epoch=0)  # ...and later batches load here
    assert target.tolist() == [6, 7]


# -- the trainer as a process ---------------------------------------------------------

SMALL = [
    "--data.name=synthetic", "--data.num_samples=40", "--training.global_batch_size=8",
    "--training.micro_batch_size=3", "--training.steps=0", "--training.epochs=3",
    "--model.name=mlp", "--model.hidden_size=16", "--training.final_loss_samples=40",
    "--logging.format=json",
]  # fmt: skip


def _train(tmp_path: Path, name: str, *args: str) -> dict[str, torch.Tensor]:
    audit = tmp_path / name
    proc = run_main(  # python -m elastic_train.main, forked (tests/workers.py)
        [*SMALL, *args, f"--logging.audit_dir={audit}",
         f"--checkpoint.dir={tmp_path / (name + '-ckpt')}"], timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prefetch_" not in proc.stderr  # the workers never fell out of step
    return torch.load(audit / "final_params.pt", weights_only=True)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_workers_train_exactly_what_the_training_process_loads(tmp_path: Path) -> None:
    # Epoch mode, 5 steps an epoch with a short last one, 3 micro-batches a step;
    # workers that are not persistent start again every epoch.
    here = _train(tmp_path, "here")
    ahead = _train(tmp_path, "ahead", "--data.num_workers=2", "--data.prefetch_factor=3")
    assert here.keys() == ahead.keys()
    for name in here:
        assert torch.equal(here[name], ahead[name]), name


def _trainer_with_workers(tmp_path: Path, log_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(MAIN_SCRIPT), "--data.name=tests.loader_data:logged_synthetic",
         f"--data.options.log_dir={log_dir}", "--data.num_samples=64",
         "--training.global_batch_size=8", "--training.steps=400",
         "--model.name=tests.paced_model:paced_mlp", "--model.options.seconds=0.05",
         "--data.num_workers=2", "--data.persistent_workers=true", "--logging.format=json",
         f"--checkpoint.dir={tmp_path / 'ckpt'}", "--checkpoint.interval_steps=0"],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # a process group of its own, as torchrun starts workers
    )  # fmt: skip


@pytest.mark.slow
def test_no_loader_worker_outlives_a_killed_or_terminated_trainer(tmp_path: Path) -> None:
    # SIGKILL: the trainer cannot shut its workers down; the kernel ends them with it.
    killed = _trainer_with_workers(tmp_path, tmp_path / "killed")
    try:
        wait_for(lambda: len(loader_workers(tmp_path / "killed")) == 2, timeout=120,
                 what="two loader workers")  # fmt: skip
        workers = loader_workers(tmp_path / "killed")
        assert {w["ppid"] for w in workers} == {killed.pid}
        killed.kill()
        killed.wait(timeout=10)
        wait_for(lambda: not any(psutil.pid_exists(w["pid"]) for w in workers), timeout=3,
                 what="the loader workers of the killed trainer to end")  # fmt: skip
    finally:
        killed.kill()
    # SIGTERM to the whole process group, as torchrun's agent stops a worker: the
    # workers leave the signal to the trainer, which saves at an agreed step and
    # exits 0 without a worker dying under it; then its workers are gone too.
    termed = _trainer_with_workers(tmp_path, tmp_path / "termed")
    try:
        wait_for(lambda: len(loader_workers(tmp_path / "termed")) == 2, timeout=120,
                 what="two loader workers")  # fmt: skip
        workers = loader_workers(tmp_path / "termed")
        os.killpg(termed.pid, signal.SIGTERM)
        _, stderr = termed.communicate(timeout=60)
        assert termed.returncode == 0, stderr[-3000:]
        assert "worker_exit_after_preemption" in stderr
        assert list((tmp_path / "ckpt").glob("step-*")), "the preempted trainer saved"
        wait_for(lambda: not any(psutil.pid_exists(w["pid"]) for w in workers), timeout=3,
                 what="the loader workers of the terminated trainer to end")  # fmt: skip
    finally:
        termed.kill()


# -- real nodes, real faults -----------------------------------------------------------

#: 96 samples in global batches of 16: 6 steps an epoch; micro-batches of 4, so
#: a rank's shard takes 2 forwards at world 2 and 3. Each forward sleeps 0.08 s
#: (tests/steered_model.py, a sleep costs no CPU) until the joined world trains,
#: so the 110 steps after the join trigger leave the joiner 17 s or more to
#: start (on 2 cores shared with other test runs a joiner took over 11 s); the
#: steps after that run unpaced.
CHAOS_STEPS = 120
CHAOS_PAUSE_S = 0.08
CHAOS_ARGS = [
    "--data.num_samples=96", "--training.global_batch_size=16",
    "--training.micro_batch_size=4", f"--training.steps={CHAOS_STEPS}",
    "--training.final_loss_samples=96", "--checkpoint.interval_steps=4",
    "--model.name=tests.steered_model:steered",
]  # fmt: skip


def _chaos_run(run_dir: Path, *, nodes: int, args: list[str]) -> tuple[dict[str, Any], list[Any]]:
    """``elastic-train local`` with a kill and a join; returns the summary and
    every loader worker seen running without its trainer for over 3 s."""
    pace = Pace(run_dir.parent / "pause", CHAOS_PAUSE_S)
    command = [
        "--nodes", str(nodes), "--min-nodes", str(nodes - 1),
        "--chaos", "kill:1@step6,join:1@step10", "--run-dir", str(run_dir),
        "--timeout", "240", "--metrics-port", "0", *CHAOS_ARGS,
        f"--model.options.pause_file={pace.path}", "--data.num_workers=2",
        "--data.persistent_workers=true", *args,
    ]  # fmt: skip
    first_orphaned: dict[int, float] = {}
    leftovers: list[Any] = []

    def look_for_orphans() -> None:
        now = time.monotonic()
        for info in orphaned(loader_workers(run_dir / "loads")):
            since = first_orphaned.setdefault(info["pid"], now)
            if now - since > 3 and info not in leftovers:
                leftovers.append(info)

    summary = run_steered(run_dir, command, pace=pace, nodes=nodes, env=ENV,
                          on_tick=look_for_orphans, join_wait=JOIN_WAIT_S)  # fmt: skip
    return summary, leftovers


def _reference(tmp_path: Path, args: list[str]) -> dict[str, torch.Tensor]:
    """The same job in one process, no workers, no faults, no pacing."""
    params, _ = forked_reference(tmp_path / "ref", [*CHAOS_ARGS, *args])
    return params


def _assert_same_weights(run_dir: Path, expected: dict[str, torch.Tensor]) -> None:
    actual = torch.load(run_dir / "audit" / "final_params.pt", weights_only=True)
    assert expected.keys() == actual.keys()
    for name in expected:
        # Summation order differs between world sizes; a sample skipped, repeated
        # or swapped for a prefetched one would move the weights by ~1e-3.
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-5)


def _assert_kill_then_join(summary: dict[str, Any], *, nodes: int) -> None:
    assert summary["completed"], summary
    assert summary["final_step"] == CHAOS_STEPS
    assert summary["exactly_once"], summary["exactly_once_detail"]
    assert f"{CHAOS_STEPS // 6} finished epochs" in summary["exactly_once_detail"]
    assert [(r["kind"], r["node"], r["world_size_after"]) for r in summary["recoveries"]] == [
        ("kill", 1, nodes - 1),
        ("join", 1, nodes),
    ]


@pytest.mark.slow
def test_workers_reading_a_stream_through_a_kill_and_a_join_use_every_position_once(
    tmp_path: Path,
) -> None:
    # One run for two properties: DataLoader workers through a kill and a join,
    # and a stream (PositionalStream) through a resize (world 3 -> 2 -> 3), each
    # rank reading on from the position it restored.
    run_dir = tmp_path / "run"
    loads = run_dir / "loads"
    data = ["--data.name=tests.loader_data:logged_stream", f"--data.options.log_dir={loads}"]
    summary, leftovers = _chaos_run(run_dir, nodes=3, args=data)
    _assert_kill_then_join(summary, nodes=3)
    # The workers read more than the steps committed (batches prefetched for
    # steps the kill cut short, and the steps redone after it), and none of it
    # counted: the audit above is exactly once...
    committed = summary["final_step"] * 16
    assert len(loaded_indices(loads)) > committed
    # ...and the weights are those of one process that read every position itself.
    _assert_same_weights(run_dir, _reference(tmp_path, ["--data.name=synthetic_stream"]))
    assert leftovers == []  # no loader worker outlived its trainer
    assert len(loader_workers(loads)) >= 2 * 5  # 3 trainers, 2 restarted, 1 joined


# -- streams ------------------------------------------------------------------------


def test_a_stream_reads_any_position_run_of_an_epoch_and_is_not_shuffled_again() -> None:
    data = DATASETS.resolve("synthetic_stream")(DataConfig(num_samples=50))
    stream = data.dataset
    assert data.streamed and len(data) == 50
    for epoch in (0, 1):
        whole = torch.stack([x for x, _ in stream.read(epoch, 0, 50)])
        positions = [*range(7, 20), *range(31, 34), 49]  # three runs, across shard borders
        picked = torch.stack([x for x, _ in stream_items(stream, positions, epoch=epoch)])
        assert torch.equal(picked, whole[positions])
    first, second = (torch.stack([x for x, _ in stream.read(e, 0, 50)]) for e in (0, 1))
    assert not torch.equal(first, second)  # the stream shuffles its shards per epoch...
    assert sorted(first.sum(1).tolist()) == sorted(second.sum(1).tolist())  # ...same records
    sampler = ElasticSampler.for_data(data, global_batch_size=16, seed=3)
    assert sampler.next_global_batch() == list(range(16))  # positions, in stream order
    assert sampler.state_dict() == {"seed": 3, "epoch": 0, "samples_consumed": 16}


class ShortStream:
    def __len__(self) -> int:
        return 10

    def read(self, epoch: int, start: int, count: int) -> list[int]:
        return list(range(start, min(start + count, 4)))  # stops early


def test_a_stream_that_yields_too_few_items_is_named() -> None:
    assert isinstance(ShortStream(), PositionalStream)
    assert stream_items(ShortStream(), [1, 2], epoch=0) == [1, 2]
    expected = r"data.name: ShortStream.read\(epoch=0, start=3, count=3\) yielded 1 items; "
    with pytest.raises(ConfigError, match=expected + r".* must yield exactly count"):
        stream_items(ShortStream(), [0, 3, 4, 5], epoch=0)


class Endless(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


def test_an_iterable_dataset_without_a_position_is_refused_naming_the_interface() -> None:
    with pytest.raises(ConfigError) as info:
        DataBundle(Endless(), {})
    text = str(info.value)
    assert text.startswith("data.name: Endless is an IterableDataset")
    assert "PositionalStream (__len__ and read(epoch, start, count))" in text
