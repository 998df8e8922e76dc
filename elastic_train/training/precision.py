"""Mixed precision: ``fp32``, ``bf16`` or ``fp16`` via ``torch.autocast``.

bf16 has fp32's exponent range, so it needs no loss scaling. fp16 does: its
gradients underflow, so fp16 runs a ``GradScaler`` whose state (current scale,
growth tracker) is part of the checkpoint; without it a resumed run would start
again at the initial scale of 2**16 and skip steps while it backs off.

Parameters and optimizer state stay fp32 in every mode; only the forward and
backward matmuls run in the low-precision type.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch

from elastic_train.errors import ConfigError

PrecisionName = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def validate_precision(name: str) -> PrecisionName:
    if name not in PRECISIONS:
        raise ConfigError(f"training.precision={name!r} is not one of {', '.join(PRECISIONS)}")
    return name  # type: ignore[return-value]


class Precision:
    """Autocast plus (for fp16) loss scaling, for one device type.

    Use as::

        with precision.autocast():
            loss = loss_fn(model(x), y)
        precision.backward(loss)
        precision.step(optimizer)   # unscale, step (skipped on inf/nan), update
    """

    def __init__(self, name: str, *, device: torch.device | str) -> None:
        self.name = validate_precision(name)
        self.device = torch.device(device)
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(self.device.type) if self.name == "fp16" else None
        )

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES.get(self.name, torch.float32)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place, e.g. before clipping them."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; False when fp16 found inf/nan and skipped the step."""
        if self.scaler is None:
            optimizer.step()
            return True
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # The scaler lowers its scale exactly when it skipped the step.
        return self.scaler.get_scale() >= scale_before

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers only, so the checkpoint loads with ``weights_only=True``."""
        if self.scaler is None:
            return {"precision": self.name}
        return {"precision": self.name, "scaler": dict(self.scaler.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A run may switch precision between restarts (e.g. fp16 -> bf16): the
        # scaler state only means something to an fp16 run.
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
