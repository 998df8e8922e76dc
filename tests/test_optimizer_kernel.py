"""``optimizer.implementation``: which of torch's kernels the built-in optimizers
run, and that the fused kernel picked by default computes the same update as
torch's per-tensor loop; the trainer's gradient clipping against torch's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastic_train.config.load import load_config
from elastic_train.errors import ConfigError
from elastic_train.training.optim import build_optimizer, clip_grad_norm


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)


def _optimizer(*overrides: str, device: str = "cpu") -> torch.optim.Optimizer:
    return build_optimizer(load_config(None, list(overrides)).optimizer, _model(device))


def test_auto_fuses_adamw_on_cpu_and_leaves_sgd_and_other_devices_to_torch() -> None:
    assert _optimizer().defaults["fused"] is True
    assert not _optimizer("optimizer.name=sgd").defaults.get("fused")
    assert not _optimizer(device="meta").defaults.get("fused")  # no fused kernel there
    assert _optimizer("optimizer.implementation=for-loop").defaults["foreach"] is False
    assert _optimizer("optimizer.implementation=foreach").defaults["foreach"] is True


def test_a_kernel_torch_refuses_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        _optimizer("optimizer.implementation=fused", device="meta")
    text = str(info.value)
    assert text.startswith("optimizer.implementation = 'fused': torch has no fused adamw")
    assert "torch.float32 on meta" in text and "accepted: auto, for-loop, foreach, fused" in text


def test_an_unknown_kernel_names_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["optimizer.implementation=fast"])
    text = str(info.value)
    assert "optimizer.implementation" in text and "'for-loop'" in text, text


def test_fused_adamw_trains_like_the_per_tensor_loop() -> None:
    """Clipping and weight decay on, 40 steps: the kernels may differ in the
    last bits of a float, not in the update."""
    common = ("optimizer.weight_decay=0.1", "optimizer.lr=0.01")
    runs = {}
    for kernel in ("fused", "for-loop"):
        cfg = load_config(None, [*common, f"optimizer.implementation={kernel}"])
        model = _model()
        optimizer = build_optimizer(cfg.optimizer, model)
        data = torch.Generator().manual_seed(1)
        for _ in range(40):
            x = torch.randn(16, 8, generator=data)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        runs[kernel] = [p.detach().clone() for p in model.parameters()]
    start = [p.detach() for p in _model().parameters()]
    moved = max((a - b).abs().max().item() for a, b in zip(runs["fused"], start, strict=True))
    assert moved > 0.05  # the steps changed the weights, so agreement below means something
    for fused, loop in zip(runs["fused"], runs["for-loop"], strict=True):
        torch.testing.assert_close(fused, loop, rtol=0, atol=1e-5)


def _with_gradients(dtypes: tuple[torch.dtype, ...]) -> nn.Module:
    model = _model()
    noise = torch.Generator().manual_seed(2)
    for p, dtype in zip(model.parameters(), dtypes * 4, strict=False):
        p.data = p.data.to(dtype)
        p.grad = (3 * torch.randn(p.shape, generator=noise)).to(dtype)
    model[0].bias.grad = None  # a parameter without a gradient: skipped
    return model


@pytest.mark.parametrize(
    "dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float32, torch.float64)]
)  # the last one is torch's own path: one stacked norm needs one dtype
@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # scaled down, and left alone
def test_clipping_gives_torch_s_gradients_bit_for_bit(
    dtypes: tuple[torch.dtype, ...], max_norm: float
) -> None:
    ours, theirs = _with_gradients(dtypes), _with_gradients(dtypes)
    clip_grad_norm(ours, max_norm)
    nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
    pairs = list(zip(ours.parameters(), theirs.parameters(), strict=True))
    assert [a.grad is None for a, _ in pairs] == [b.grad is None for _, b in pairs]
    clipped = [(a.grad, b.grad) for a, b in pairs if a.grad is not None]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in clipped)
    norm = torch.linalg.vector_norm(torch.stack([a.double().norm() for a, _ in clipped]))
    assert norm <= max_norm * 1.01
