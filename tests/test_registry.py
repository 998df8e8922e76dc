"""Models, datasets and losses by registered name or by import string."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from torch import nn

from elastic_train.config.job import DataConfig, ModelConfig
from elastic_train.errors import ConfigError
from elastic_train.workload import models
from elastic_train.workload.datasets import load_batch
from elastic_train.workload.registry import (
    DATASETS,
    LOSSES,
    MODELS,
    SUM_COUNT_LOSSES,
    Registry,
)


def tiny_linear(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    """A user's own factory, found through the import string test_registry:tiny_linear."""
    return nn.Linear(info["in_features"], info["num_classes"], bias=bool(cfg.options["bias"]))


def test_builtin_names() -> None:
    assert {"mlp", "char_transformer"} <= set(MODELS.names())
    assert {"synthetic", "digits", "founding_documents"} <= set(DATASETS.names())
    assert {"cross_entropy", "mse"} <= set(LOSSES.names())
    assert "token_cross_entropy" in SUM_COUNT_LOSSES.names()
    assert "token_cross_entropy" not in LOSSES.names()  # each form has its own names


def test_import_string_resolves_user_code() -> None:
    factory = MODELS.resolve("test_registry:tiny_linear")
    model = factory(ModelConfig(options={"bias": False}), {"in_features": 3, "num_classes": 2})
    assert isinstance(model, nn.Linear) and model.bias is None
    assert MODELS.resolve("elastic_train.models:mlp") is models.mlp
    assert MODELS.resolve("elastic_train.workload.models:CharTransformer") is models.CharTransformer


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("resnet", "unknown model; use one of char_transformer, mlp"),
        ("no_such_module_xyz:factory", "cannot import 'no_such_module_xyz'"),
        ("elastic_train.workload.models:nope", "has no 'nope'"),
        ("elastic_train.workload.models:", "expected an import string"),
        ("elastic_train.workload.models:F.__name__", "not callable"),
    ],
)
def test_bad_model_spec_names_the_field(spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        MODELS.resolve(spec)
    assert str(info.value).startswith(f"model.name = {spec!r}")
    assert message in str(info.value)


def test_unknown_dataset_and_loss_name_their_fields() -> None:
    with pytest.raises(ConfigError, match=r"^data\.name = 'imagenet': unknown dataset"):
        DATASETS.resolve("imagenet")
    with pytest.raises(ConfigError, match=r"^model\.loss = 'hinge': unknown loss"):
        LOSSES.resolve("hinge")


def test_duplicate_registration_is_refused() -> None:
    registry: Registry = Registry("thing", field="x.name")
    registry.register("a")(len)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a")(len)


def test_model_needs_matching_dataset() -> None:
    with pytest.raises(ConfigError, match="needs a dataset that provides 'vocab_size'"):
        MODELS.resolve("char_transformer")(ModelConfig(), {"in_features": 4, "num_classes": 2})


def test_builtin_datasets_are_real_and_deterministic() -> None:
    digits = DATASETS.resolve("digits")(DataConfig())
    assert len(digits) == 1797 and dict(digits.info) == {"in_features": 64, "num_classes": 10}
    x, y = load_batch(digits.dataset, range(len(digits)))
    assert x.min() >= 0 and x.max() <= 1 and set(y.tolist()) == set(range(10))

    text = DATASETS.resolve("founding_documents")(DataConfig(seq_len=32))
    inputs, targets = load_batch(text.dataset, [0, 1])
    assert inputs.shape == (2, 32)
    assert torch.equal(inputs[0, 1:], targets[0, :-1])  # targets are the next characters
    assert torch.equal(targets[0, -1], inputs[1, 0])  # windows tile the text

    a = DATASETS.resolve("synthetic")(DataConfig(num_samples=50))
    b = DATASETS.resolve("synthetic")(DataConfig(num_samples=50))
    assert torch.equal(a.dataset.tensors[0], b.dataset.tensors[0])  # type: ignore[attr-defined]
    assert len(set(a.dataset.tensors[1].tolist())) > 1  # type: ignore[attr-defined]


def test_cross_entropy_is_per_sample() -> None:
    logits = torch.randn(3, 5, 7)
    targets = torch.randint(0, 7, (3, 5))
    per_sample = LOSSES.resolve("cross_entropy")(logits, targets)
    assert per_sample.shape == (3,)
    expected = torch.nn.functional.cross_entropy(logits.reshape(15, 7), targets.reshape(15))
    torch.testing.assert_close(per_sample.mean(), expected)


def test_cross_entropy_of_one_position_per_sample_is_each_samples_loss() -> None:
    logits = torch.randn(6, 7)
    targets = torch.randint(0, 7, (6,))
    per_sample = LOSSES.resolve("cross_entropy")(logits, targets)
    assert per_sample.shape == (6,)
    for i in range(6):
        expected = torch.nn.functional.cross_entropy(logits[i : i + 1], targets[i : i + 1])
        torch.testing.assert_close(per_sample[i], expected)
