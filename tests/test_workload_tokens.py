"""Variable-length token batches: dict batches, a padding collate function and
a ``(loss_sum, count)`` loss normalised by the global token count.

The world-size test runs the real trainer in 1, 2 and 3 gloo processes
(``trainer_procs``) on sequences of 2 to 12 tokens, padded per micro-batch, so
ranks and micro-batches hold different numbers of tokens. Its control shows
that the usual mistake, each rank's own token mean averaged over ranks, fails
the same comparison. The factories below are the workload, loaded by import
string (``test_workload_tokens:token_data``) in the worker processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset
from trainer_procs import final_params, run_workers

from elastic_train.config.job import DataConfig
from elastic_train.config.load import load_config
from elastic_train.training.optim import build_optimizer, build_scheduler
from elastic_train.training.sampler import ElasticSampler
from elastic_train.workload.datasets import DataBundle
from elastic_train.workload.models import IGNORE_INDEX, token_cross_entropy
from elastic_train.workload.registry import DATASETS, MODELS

VOCAB = 11
MAX_TOKENS = 13  # a sequence of at most 13 tokens: 12 inputs and 12 targets
STEPS = 10  # 60 sequences in global batches of 12: two epochs of 5 steps
ATOL = 2e-6

TOKEN_JOB = (
    "model.name=char_transformer",
    "model.hidden_size=16",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.loss=token_cross_entropy",
    "model.loss_form=sum_count",
    "data.name=test_workload_tokens:token_data",
    "data.collate_fn=test_workload_tokens:pad_tokens",
    "data.num_samples=60",
    "training.global_batch_size=12",
    "training.micro_batch_size=3",
    f"training.steps={STEPS}",
    "training.final_loss_samples=60",
    # SGD, not AdamW: Adam divides each gradient by its own scale, so it would
    # hide a wrong global scale, and it turns the rounding noise of gradients
    # that are zero in exact arithmetic (the attention's key bias) into
    # lr-sized steps that differ between world sizes.
    "optimizer.name=sgd",
    "optimizer.lr=0.2",
    "schedule.name=constant",
    "schedule.warmup_steps=3",
    "checkpoint.dir=",
    "logging.level=WARNING",
    "logging.format=json",
)


class TokenSequences(Dataset[dict[str, torch.Tensor]]):
    """Item ``i``: a dict of ``input_ids`` and next-token ``labels`` of one length."""

    def __init__(self, sequences: list[torch.Tensor]) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        seq = self.sequences[index]
        return {"input_ids": seq[:-1], "labels": seq[1:]}


def sequences(count: int, seed: int) -> list[torch.Tensor]:
    """Learnable sequences (each token mostly follows from the one before) of 3-13 tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        length = int(torch.randint(3, MAX_TOKENS + 1, (1,), generator=gen))
        seq = [int(torch.randint(1, VOCAB, (1,), generator=gen))]
        for _ in range(length - 1):
            noise = int(torch.randint(1, VOCAB, (1,), generator=gen))
            follows = bool(torch.rand(1, generator=gen) < 0.8)
            seq.append(max(seq[-1] * 3 % VOCAB, 1) if follows else noise)
        out.append(torch.tensor(seq))
    return out


def token_data(cfg: DataConfig) -> DataBundle:
    info = {"vocab_size": VOCAB, "seq_len": MAX_TOKENS - 1}
    return DataBundle(TokenSequences(sequences(cfg.num_samples, cfg.seed)), info)


def pad_tokens(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest item of the micro-batch; padded labels are ignored."""
    width = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, : len(item["input_ids"])] = item["input_ids"]
        labels[row, : len(item["labels"])] = item["labels"]
    return {"input_ids": ids, "labels": labels}


def rank_mean_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The usual mistake, for the control: the micro-batch's own token mean,
    counted as one unit. With one micro-batch per rank the step then averages
    the ranks' means, whatever their token counts."""
    loss_sum, count = token_cross_entropy(model, batch)
    return loss_sum / count, 1


def _tokens(indices: list[int], data: list[torch.Tensor]) -> int:
    return sum(len(data[i]) - 1 for i in indices)


def _records(audit: Path) -> list[dict[str, Any]]:
    lines = [line for p in sorted(audit.glob("worker-*.jsonl")) for line in p.read_text().split()]
    return [r for r in map(json.loads, lines) if r["kind"] == "step"]


def _train(tmp_path: Path, world_size: int, *extra: str, log: Path | None = None) -> Path:
    audit = tmp_path / f"w{world_size}-{abs(hash(extra))}"
    run_workers(world_size, [*TOKEN_JOB, f"logging.audit_dir={audit}", *extra], stderr=log)
    return audit


def _initial_params() -> dict[str, torch.Tensor]:
    cfg = load_config(None, TOKEN_JOB)
    data = DATASETS.resolve(cfg.data.name)(cfg.data)
    torch.manual_seed(cfg.training.seed)
    return MODELS.resolve(cfg.model.name)(cfg.model, data.info).state_dict()


@pytest.mark.slow
def test_token_normalisation_does_not_depend_on_world_size(tmp_path: Path) -> None:
    log = tmp_path / "w2.log"
    audits = {
        1: _train(tmp_path, 1),
        2: _train(tmp_path, 2, "logging.level=INFO", log=log),
        3: _train(tmp_path, 3),
    }
    results = {w: final_params(audit) for w, audit in audits.items()}

    # Not vacuous: the two ranks hold different numbers of tokens, and training
    # moved the weights far beyond the tolerance.
    data = sequences(60, DataConfig().seed)
    first = sorted((r for r in _records(audits[2]) if r["step"] == 1), key=lambda r: r["rank"])
    tokens = [_tokens(r["indices"], data) for r in first]
    assert len(tokens) == 2 and tokens[0] != tokens[1], tokens
    start = _initial_params()
    moved = max((results[1][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1000 * ATOL, moved
    for world_size in (2, 3):
        for name, reference in results[1].items():
            torch.testing.assert_close(
                results[world_size][name], reference, atol=ATOL, rtol=0,
                msg=lambda m, n=name, w=world_size: f"{n} at world size {w}: {m}",
            )  # fmt: skip

    # Each audit record's loss is its rank's mean per token; weighted by the
    # ranks' tokens they give the global mean per token that the step logs.
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    (logged,) = {e["loss"] for e in events if e["event"] == "step" and e["step"] == 1}
    weighted = sum(r["loss"] * n for r, n in zip(first, tokens, strict=True)) / sum(tokens)
    assert weighted == pytest.approx(logged, abs=1e-5)


@pytest.mark.slow
def test_per_rank_token_mean_fails_the_same_comparison(tmp_path: Path) -> None:
    """The control: the same job normalised the usual wrong way drifts with the world size."""
    wrong = ("model.loss=test_workload_tokens:rank_mean_loss", "training.micro_batch_size=0")
    results = {w: final_params(_train(tmp_path, w, *wrong)) for w in (1, 2)}
    differs = max((results[1][k] - results[2][k]).abs().max().item() for k in results[1])
    assert differs > 1000 * ATOL, differs


@pytest.mark.slow
def test_update_is_clipped_sgd_on_the_mean_per_token_of_the_global_batch(tmp_path: Path) -> None:
    """2 workers against a plain loop over whole global batches: the mean per
    token, then clipping (active at every step) and the SGD step. A per-rank
    normalisation, or a rescale after the clipping, gives other weights."""
    steps = 4
    job = [*TOKEN_JOB, f"training.steps={steps}", "optimizer.grad_clip=0.05"]
    audit = tmp_path / "audit"
    run_workers(2, [*job, f"logging.audit_dir={audit}"])

    cfg = load_config(None, job)
    data = DATASETS.resolve(cfg.data.name)(cfg.data)
    torch.manual_seed(cfg.training.seed)
    model = MODELS.resolve(cfg.model.name)(cfg.model, data.info)
    optimizer = build_optimizer(cfg.optimizer, model)
    scheduler = build_scheduler(cfg, optimizer, total=steps, world_size=1)
    sampler = ElasticSampler(len(data), global_batch_size=12, seed=cfg.training.seed)
    norms = []
    for _ in range(steps):
        batch = pad_tokens([data.dataset[i] for i in sampler.next_global_batch()])
        loss_sum, count = token_cross_entropy(model, batch)
        (loss_sum / count).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    assert min(norms) > 2 * cfg.optimizer.grad_clip, norms  # clipping changed every step
    got = final_params(audit)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=0, msg=name)
