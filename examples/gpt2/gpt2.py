"""A Hugging Face ``transformers`` GPT-2, built from a tiny config (nothing is
downloaded), trained on the bundled text (the opening of the US Constitution,
public domain) with dict batches and a loss normalised by the token count.

The factories below are named by ``local.toml`` (``--config``)::

    pip install -e ".[examples]"
    elastic-train local --config examples/gpt2/local.toml
    elastic-train local --config examples/gpt2/local.toml --nodes 3 \\
        --chaos kill:1@step20,join:1@step40 \\
        --rdzv-conf preload=transformers.models.gpt2.modeling_gpt2

The workers import this module as ``examples.gpt2.gpt2``: run from a checkout
of this repository (``elastic_train/main.py`` puts the checkout first on
``sys.path``), or put the checkout on ``PYTHONPATH``.

Samples are the text's clauses (up to a ``.``, ``;``, ``:`` or ``,``) as
bytes (token ids 0-255, 256 pads), 8 to 64 tokens long: 319 of them. A
micro-batch is padded to its longest clause; the loss is the sum over the real
next-token predictions and the count is their number, so every token weighs
the same at any world size (docs/training.md, "World-size invariance").
``local.toml`` shards the model with FSDP2 (``training.parallel = "fsdp2"``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from elastic_train.config.job import DataConfig, ModelConfig
from elastic_train.errors import ConfigError
from elastic_train.workload.datasets import DataBundle

TEXT = Path(__file__).resolve().parent / "constitution.txt"
PAD = 256
VOCAB = 257
MAX_TOKENS = 64
MIN_TOKENS = 8
IGNORE = -100  # label of padding: cross_entropy skips it


def clauses(text: str) -> list[torch.Tensor]:
    """Each clause (up to a . ; : or ,) as byte ids, cut to MAX_TOKENS."""
    pieces = re.split(r"(?<=[.;:,])\s+", " ".join(text.split()))
    ids = [torch.tensor(list(p.encode("ascii")[:MAX_TOKENS])) for p in pieces]
    return [t for t in ids if len(t) >= MIN_TOKENS]


def dataset(cfg: DataConfig) -> DataBundle:
    """``data.name = "examples.gpt2.gpt2:dataset"``: one dict per clause."""
    items = [{"input_ids": ids} for ids in clauses(TEXT.read_text(encoding="ascii"))]
    return DataBundle(items, {"vocab_size": VOCAB, "n_positions": MAX_TOKENS}, collate_fn=pad)


def pad(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the micro-batch's longest clause; labels are -100 on padding."""
    ids = [item["input_ids"] for item in items]
    return {
        "input_ids": pad_sequence(ids, batch_first=True, padding_value=PAD),
        "attention_mask": pad_sequence([torch.ones_like(i) for i in ids], batch_first=True),
        "labels": pad_sequence(ids, batch_first=True, padding_value=IGNORE),
    }


def model(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    """``model.name = "examples.gpt2.gpt2:model"``: GPT2LMHeadModel from a tiny GPT2Config."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:
        raise ConfigError(
            'model.name = "examples.gpt2.gpt2:model" needs transformers: '
            'pip install -e ".[examples]"'
        ) from exc
    config = GPT2Config(
        vocab_size=info["vocab_size"], n_positions=info["n_positions"],
        n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_heads,
        # No dropout: the update is then the same at every world size.
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def loss(net: nn.Module, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.loss = "examples.gpt2.gpt2:loss"`` (``loss_form = "sum_count"``).

    Not the model's own ``loss`` output, which is a mean over this micro-batch's
    tokens: summed here and counted, the trainer divides by the tokens of the
    whole global batch.
    """
    logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]  # position t predicts token t + 1
    loss_sum = nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels.flatten(),
        ignore_index=IGNORE, reduction="sum",
    )  # fmt: skip
    return loss_sum, (labels != IGNORE).sum()
