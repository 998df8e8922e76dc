"""The training step and loop: schedule, batch modes, micro-batching, resume at a new world size."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from trainer_procs import TINY_JOB, final_params, run_workers

from elastic_train.config.job import ScheduleConfig, TrainingConfig
from elastic_train.config.load import load_config
from elastic_train.errors import ConfigError
from elastic_train.training.loop import checkpoint_due
from elastic_train.training.optim import (
    build_scheduler,
    global_batch_size,
    lr_multiplier,
)
from elastic_train.training.step import micro_batches

ATOL = 2e-6


def test_lr_schedules() -> None:
    cosine = ScheduleConfig(name="cosine", warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_multiplier(cosine, s, total=20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(cosine, 4, total=20) == 1.0
    assert math.isclose(lr_multiplier(cosine, 12, total=20), 0.55)  # halfway: mean of 1 and 0.1
    assert math.isclose(lr_multiplier(cosine, 20, total=20), 0.1)
    linear = ScheduleConfig(name="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert math.isclose(lr_multiplier(linear, 5, total=10), 0.5)
    constant = ScheduleConfig(name="constant", warmup_steps=0)
    assert lr_multiplier(constant, 1000, total=10) == 1.0


def test_world_size_larger_than_the_global_batch_is_refused() -> None:
    cfg = TrainingConfig(global_batch_size=4)
    assert global_batch_size(cfg, 4) == 4
    with pytest.raises(ConfigError, match=r"training\.global_batch_size = 4 .* world size 5"):
        global_batch_size(cfg, 5)


def test_per_worker_mode_scales_batch_and_learning_rate() -> None:
    cfg = load_config(
        None,
        ["training.batch_mode=per_worker", "training.worker_batch_size=8",
         "schedule.name=constant", "schedule.warmup_steps=0", "optimizer.lr=0.1"],
    )  # fmt: skip
    assert global_batch_size(cfg.training, 3) == 24
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimizer.lr)
    build_scheduler(cfg, optimizer, total=10, world_size=3)
    assert math.isclose(optimizer.param_groups[0]["lr"], 0.3)


def test_epochs_mode_counts_steps_with_a_short_last_batch() -> None:
    cfg = TrainingConfig(steps=0, epochs=2)
    assert cfg.total_steps(dataset_len=98, batch_size=16) == 14
    assert cfg.total_steps(dataset_len=96, batch_size=16) == 12


def test_micro_batches_cover_the_shard_in_order() -> None:
    assert micro_batches([1, 2, 3, 4, 5, 6, 7], 3) == [[1, 2, 3], [4, 5, 6], [7]]
    assert micro_batches([1, 2], 0) == [[1, 2]]
    assert micro_batches([], 3) == []


@pytest.mark.slow
def test_gradient_accumulation_matches_one_pass(tmp_path: Path) -> None:
    results = {}
    for micro in (0, 3):
        audit = tmp_path / f"micro{micro}"
        overrides = [f"training.micro_batch_size={micro}", f"logging.audit_dir={audit}"]
        run_workers(1, [*TINY_JOB, "training.steps=8", "checkpoint.dir=", *overrides])
        results[micro] = final_params(audit)
    for name, value in results[0].items():
        torch.testing.assert_close(results[3][name], value, atol=ATOL, rtol=0)


def _records(audit: Path, kind: str) -> list[dict]:
    records = []
    for path in sorted(audit.glob("worker-*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if r["kind"] == kind]


def _logged(text: str, event: str) -> list[dict]:
    events = []
    for line in text.splitlines():
        if line.startswith("{") and f'"event": "{event}"' in line:
            events.append(json.loads(line))
    return events


@pytest.mark.slow
def test_resume_at_other_world_sizes_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    """3 workers crash after step 7 (its checkpoint incomplete), 2 resume, 3 finish.

    7 steps make one epoch, so the resumed runs redo the end of epoch 0 and
    cross into epoch 1 at different world sizes than the reference.
    """
    job = [*TINY_JOB, "checkpoint.interval_steps=5", "logging.level=INFO"]
    reference = tmp_path / "reference"
    run_workers(1, [*job, "training.steps=14", "checkpoint.dir=", f"logging.audit_dir={reference}"])
    ckpt = tmp_path / "ckpt"
    audit = tmp_path / "audit"
    phase = [*job, f"checkpoint.dir={ckpt}", f"logging.audit_dir={audit}"]

    first = tmp_path / "first.log"
    run_workers(3, [*phase, "training.steps=7"], stderr=first)
    # Each rank's audit record has its own mean loss; weighted by its samples
    # they make the global loss of the step's log line.
    (logged,) = {e["loss"] for e in _logged(first.read_text(), "step") if e["step"] == 1}
    ones = [r for r in _records(audit, "step") if r["step"] == 1]
    assert len(ones) == 3 and len({r["loss"] for r in ones}) == 3
    weighted = sum(r["loss"] * len(r["indices"]) for r in ones)
    assert weighted / sum(len(r["indices"]) for r in ones) == pytest.approx(logged, abs=1e-5)
    # A crash while step 7 was being written: the manifest is written last.
    (ckpt / "step-000000007" / "MANIFEST.json").unlink()
    log = tmp_path / "resume.log"
    run_workers(2, [*phase, "training.steps=10"], stderr=log)
    resumed = _logged(log.read_text(), "resumed")
    assert {(r["restored_step"], r["lost_steps"], r["world_size"]) for r in resumed} == {(5, 2, 2)}
    run_workers(3, [*phase, "training.steps=14"])

    restarts = sorted({(r["restored_step"], r["world_size"]) for r in _records(audit, "resume")})
    assert restarts == [(0, 3), (5, 2), (10, 3)]
    assert json.loads((audit / "result.json").read_text())["final_step"] == 14
    expected, got = final_params(reference), final_params(audit)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=ATOL, rtol=0, msg=name)


def test_checkpoint_due_by_steps_or_seconds() -> None:
    cfg = load_config(None, ["checkpoint.interval_steps=5", "checkpoint.interval_seconds=30"])
    now = time.monotonic()
    due = [
        checkpoint_due(SimpleNamespace(cfg=cfg, step=step, last_save_time=saved))  # type: ignore[arg-type]
        for step, saved in [(10, now), (11, now), (11, now - 31)]
    ]
    assert due == [True, False, True]


@pytest.mark.slow
def test_checkpoints_at_intervals_epoch_ends_and_the_end(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_workers(2, [*TINY_JOB, "training.steps=9", "checkpoint.interval_steps=4",
                    "checkpoint.keep=10", f"checkpoint.dir={ckpt}"])  # fmt: skip
    saved = sorted(int(p.parent.name[5:]) for p in ckpt.glob("step-*/MANIFEST.json"))
    assert saved == [4, 7, 8, 9]  # 7: the end of epoch 0 (98 samples, batches of 16)
