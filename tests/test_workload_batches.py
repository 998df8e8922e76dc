"""Batches of any structure: moved to the device recursively, collated by the
configured function, and the built-in token loss over padded batches."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import TensorDataset

from elastic_train.config.job import DataConfig, ModelConfig
from elastic_train.errors import ConfigError
from elastic_train.training.batches import BatchLoader, to_device
from elastic_train.training.evaluate import evaluate
from elastic_train.training.losses import TrainingLoss
from elastic_train.workload.datasets import DataBundle
from elastic_train.workload.models import IGNORE_INDEX, token_cross_entropy


class Encoding(collections.UserDict):  # type: ignore[type-arg]
    """Like transformers' BatchEncoding: a Mapping that is not a dict, with a method."""

    def tokens(self) -> int:
        return int(self.data["input_ids"].numel())


class Pair(NamedTuple):
    inputs: torch.Tensor
    target: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Sample:
    pixels: torch.Tensor
    label: torch.Tensor
    name: str = "x"
    derived: int = dataclasses.field(init=False, default=0)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, collections.abc.Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    return []


def test_to_device_keeps_every_container_type_and_moves_every_tensor() -> None:
    ids = torch.arange(6).reshape(2, 3)
    counts = collections.defaultdict(list, {"a": [torch.ones(2)]})
    batch = {
        "encoding": Encoding({"input_ids": ids, "mask": torch.ones(2, 3)}),
        "pair": Pair(torch.zeros(2, 4), torch.tensor([0, 1])),
        "sample": Sample(torch.rand(2, 3), torch.tensor([1, 0]), name="y"),
        "lists": [torch.ones(1), (torch.zeros(1), "text", 3, None)],
        "counts": counts,
    }
    # The meta device shows every tensor moved without a GPU: .to() really converts.
    moved = to_device(batch, torch.device("meta"))
    assert type(moved) is dict and list(moved) == list(batch)
    assert type(moved["encoding"]) is Encoding and moved["encoding"].tokens() == 6
    assert type(moved["pair"]) is Pair and moved["pair"].target.shape == (2,)
    assert type(moved["sample"]) is Sample and moved["sample"].name == "y"
    assert moved["lists"][1][1:] == ("text", 3, None) and type(moved["lists"][1]) is tuple
    assert dict(moved["counts"]).keys() == {"a"}  # defaultdict cannot be rebuilt: a dict
    tensors = _tensors(moved)
    assert len(tensors) == len(_tensors(batch)) == 9
    assert all(t.device.type == "meta" for t in tensors)
    cpu = torch.device("cpu")
    assert to_device(batch, cpu)["pair"].inputs is batch["pair"].inputs  # no copy on the CPU


def _pad(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.nn.utils.rnn.pad_sequence([i["x"] for i in items], batch_first=True)}


def _bundle(collate: Any = None) -> DataBundle:
    items = [{"x": torch.arange(n + 1)} for n in range(5)]
    return DataBundle(items, {}, collate_fn=collate)  # type: ignore[arg-type]


def test_collate_function_precedence_and_the_error_when_it_fails() -> None:
    cpu = torch.device("cpu")
    own = BatchLoader(_bundle(_pad), DataConfig(), device=cpu)
    assert own([1, 3])["input_ids"].tolist() == [[0, 1, 0, 0], [0, 1, 2, 3]]
    configured = BatchLoader(
        _bundle(len), DataConfig(collate_fn="test_workload_batches:_pad"), device=cpu
    )
    assert configured([0, 2])["input_ids"].shape == (2, 3)  # the config key wins
    tensors = TensorDataset(torch.arange(8.0).reshape(4, 2), torch.arange(4))
    x, y = BatchLoader(DataBundle(tensors, {}), DataConfig(), device=cpu)([3, 1])
    assert y.tolist() == [3, 1] and x[0].tolist() == [6.0, 7.0]

    default = BatchLoader(_bundle(), DataConfig(), device=cpu)
    with pytest.raises(ConfigError) as info:
        default([0, 1])
    text = str(info.value)
    assert text.startswith("data.collate_fn = '' (torch's default_collate): cannot make a batch")
    assert "indices [0, 1]" in text and "dict with keys ['x']" in text
    assert "stack expects each tensor to be equal size" in text
    assert "package.module:function of collate(items: list) -> batch" in text


def test_token_loss_sums_only_real_tokens_and_counts_them() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(7, 5), torch.nn.Linear(5, 7))
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    labels = torch.tensor([[2, 3, 4, IGNORE_INDEX], [5, 6, IGNORE_INDEX, IGNORE_INDEX]])
    loss_sum, count = token_cross_entropy(model, {"input_ids": ids, "labels": labels})
    assert int(count) == 5
    real = labels != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(model(ids)[real], labels[real], reduction="sum")
    torch.testing.assert_close(loss_sum, expected)
    # Through the trainer's loss object, by registered name.
    loss = TrainingLoss(ModelConfig(loss="token_cross_entropy", loss_form="sum_count"))
    total, units = loss.micro_batch(model, (ids, labels), size=2)
    torch.testing.assert_close(total, expected)
    assert int(units) == 5
    with pytest.raises(ConfigError, match=r"model\.loss = 'cross_entropy': unknown loss of"):
        TrainingLoss(ModelConfig(loss="cross_entropy", loss_form="sum_count"))


def test_evaluation_with_a_sum_count_loss_is_the_mean_per_token() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(7, 5), torch.nn.Linear(5, 7))
    lengths = [3, 1, 4, 2, 5, 2, 3]
    items = [
        {"input_ids": torch.arange(n) % 7, "labels": (torch.arange(n) + 1) % 7} for n in lengths
    ]

    def pad(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        seq = torch.nn.utils.rnn.pad_sequence
        return {
            "input_ids": seq([i["input_ids"] for i in batch], batch_first=True),
            "labels": seq([i["labels"] for i in batch], batch_first=True, padding_value=-100),
        }

    result = evaluate(
        model, items, loss_fn=token_cross_entropy, batch_size=3,  # type: ignore[arg-type]
        loss_form="sum_count", collate_fn=pad,
    )  # fmt: skip
    with torch.no_grad():
        total = sum(
            torch.nn.functional.cross_entropy(model(i["input_ids"]), i["labels"], reduction="sum")
            for i in items
        )
    assert result.samples == len(items) and result.accuracy is None
    assert result.loss == pytest.approx(float(total) / sum(lengths), rel=1e-6)
