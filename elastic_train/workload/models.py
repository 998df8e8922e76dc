"""Built-in models and losses.

None of them uses dropout or batch statistics, so one optimizer step depends
only on the global batch and not on how it is split across workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elastic_train.config.job import ModelConfig
from elastic_train.errors import ConfigError
from elastic_train.workload.registry import LOSSES, MODELS, SUM_COUNT_LOSSES

#: Targets with this value are padding: no loss, not counted (torch's and Hugging Face's).
IGNORE_INDEX = -100


def _need(info: Mapping[str, int], key: str, model: str) -> int:
    if key not in info:
        raise ConfigError(
            f"model.name = {model!r} needs a dataset that provides {key!r}; "
            f"this dataset provides {', '.join(info) or 'nothing'}"
        )
    return int(info[key])


@MODELS.register("mlp")
def mlp(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    """``num_layers`` hidden layers of ``hidden_size`` with GELU."""
    width = _need(info, "in_features", "mlp")
    layers: list[nn.Module] = []
    for _ in range(cfg.num_layers):
        layers += [nn.Linear(width, cfg.hidden_size), nn.GELU()]
        width = cfg.hidden_size
    layers.append(nn.Linear(width, _need(info, "num_classes", "mlp")))
    return nn.Sequential(*layers)


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """A tiny GPT-style character language model."""

    def __init__(self, *, vocab_size: int, seq_len: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@MODELS.register("char_transformer")
def char_transformer(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    if cfg.hidden_size % cfg.num_heads:
        raise ConfigError(
            f"model.hidden_size = {cfg.hidden_size} must be a multiple of "
            f"model.num_heads = {cfg.num_heads}"
        )
    return CharTransformer(
        vocab_size=_need(info, "vocab_size", "char_transformer"),
        seq_len=_need(info, "seq_len", "char_transformer"),
        dim=cfg.hidden_size,
        layers=cfg.num_layers,
        heads=cfg.num_heads,
    )


@LOSSES.register("cross_entropy")
def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample cross entropy; for sequences, the mean over the sample's positions."""
    if output.dim() == 2:  # one position per sample: skip the reshape and mean nodes
        return F.cross_entropy(output, target, reduction="none")
    losses = F.cross_entropy(
        output.reshape(-1, output.shape[-1]), target.reshape(-1), reduction="none"
    )
    return losses.reshape(target.shape[0], -1).mean(dim=1)


@LOSSES.register("mse")
def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared error."""
    squared = (output - target.to(output.dtype)) ** 2
    return squared.reshape(output.shape[0], -1).mean(dim=1)


@SUM_COUNT_LOSSES.register("token_cross_entropy")
def token_cross_entropy(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy summed over the target tokens, and how many there are.

    ``batch`` is ``(inputs, targets)`` or a mapping with ``input_ids`` and
    ``labels``; targets are aligned with the model's outputs (already shifted)
    and :data:`IGNORE_INDEX` marks padding. An output with a ``logits``
    attribute (a Hugging Face ``ModelOutput``) is read through it.
    """
    if isinstance(batch, Mapping):
        inputs, targets = batch["input_ids"], batch["labels"]
    else:
        inputs, targets = batch
    output = model(inputs)
    logits = getattr(output, "logits", output)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )  # fmt: skip
    return loss_sum, (targets != IGNORE_INDEX).sum()
