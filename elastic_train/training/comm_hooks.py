"""Gradient compression as DDP communication hooks (Horovod's ``Compression``).

``fp16``/``bf16`` cast each gradient bucket before the all-reduce and back
after it (half the bytes on the wire); ``powersgd`` sends a low-rank
approximation with error feedback.

What a checkpoint keeps of PowerSGD: only the iteration counter. The other
state is either rank-local (the error-feedback residual and the warm-start
P/Q matrices belong to the rank that accumulated them, so rank 0's copy is
wrong for every other rank and meaningless after a world-size change) or is
re-derived from the seed (the numpy RNG that draws Q). The counter matters
because it decides whether PowerSGD is still in its plain all-reduce warm-up
(``start_powerSGD_iter``): without it every restart would redo the warm-up.
After a restore the residuals start at zero, as they do after DDP rebuilds
its buckets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_train.errors import ConfigError

CommHookName = Literal["none", "fp16", "bf16", "powersgd"]
COMM_HOOKS: tuple[str, ...] = ("none", "fp16", "bf16", "powersgd")


def validate_comm_hook(name: str) -> CommHookName:
    if name not in COMM_HOOKS:
        raise ConfigError(f"training.comm_hook={name!r} is not one of {', '.join(COMM_HOOKS)}")
    return name  # type: ignore[return-value]


def _cast_hook(dtype: torch.dtype) -> Callable[..., torch.futures.Future[torch.Tensor]]:
    """All-reduce each bucket in ``dtype``. torch's own ``bf16_compress_hook`` is
    refused by DDP on anything but NCCL, although gloo reduces bf16 fine."""

    def cast_compress_hook(
        process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(group.size())  # type: ignore[union-attr]

        def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            buffer.copy_(fut.value()[0])
            return buffer

        work = dist.all_reduce(compressed, group=group, async_op=True)
        return work.get_future().then(decompress)  # type: ignore[union-attr]

    # DDP checks the annotation objects; ``from __future__ import annotations``
    # would leave strings there.
    cast_compress_hook.__annotations__ = {
        "process_group": dist.ProcessGroup,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return cast_compress_hook


class CommHook:
    """The hook registered on one DDP model, and its checkpointable state."""

    def __init__(
        self,
        name: str,
        *,
        process_group: dist.ProcessGroup | None = None,
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
    ) -> None:
        self.name = validate_comm_hook(name)
        self.process_group = process_group
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter
        self.powersgd_state: Any = None
        self._pending_iter: int | None = None

    def register(self, model: DistributedDataParallel) -> DistributedDataParallel:
        """Register on ``model`` (before its first forward); returns ``model``."""
        if self.name in ("fp16", "bf16"):
            dtype = torch.float16 if self.name == "fp16" else torch.bfloat16
            model.register_comm_hook(self.process_group, _cast_hook(dtype))
        elif self.name == "powersgd":
            self.powersgd_state = self._make_powersgd_state()
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            model.register_comm_hook(self.powersgd_state, powerSGD_hook.powerSGD_hook)
            self._apply_pending()
        return model

    def _make_powersgd_state(self) -> Any:
        try:
            import numpy  # noqa: F401 - PowerSGDState draws Q with numpy
        except ImportError as exc:
            raise ConfigError(
                "training.comm_hook='powersgd' needs numpy (torch's PowerSGDState uses it); "
                "pip install numpy or choose none, fp16 or bf16"
            ) from exc
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        if self.powersgd_rank < 1:
            raise ConfigError(f"training.powersgd_rank must be >= 1, got {self.powersgd_rank}")
        return powerSGD_hook.PowerSGDState(
            process_group=self.process_group,
            matrix_approximation_rank=self.powersgd_rank,
            start_powerSGD_iter=self.powersgd_start_iter,
            # Compress every bucket, even small ones, so the setting always has an effect.
            min_compression_rate=1,
        )

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"name": self.name}
        if self.powersgd_state is not None:
            state["powersgd_iter"] = int(self.powersgd_state.iter)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; may come before :meth:`register` (the restore precedes DDP wrapping)."""
        if state.get("name") == "powersgd":
            self._pending_iter = int(state["powersgd_iter"])
        self._apply_pending()

    def _apply_pending(self) -> None:
        if self.powersgd_state is not None and self._pending_iter is not None:
            self.powersgd_state.iter = self._pending_iter
            self._pending_iter = None
