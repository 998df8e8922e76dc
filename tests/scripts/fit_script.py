"""A user's own training script for tests/test_own_script.py: it builds every
part itself and calls ``elastic_train.api.fit``.

Dict items with a collate function of its own, a ``(sum, count)`` loss, an
AdamW with two parameter groups and a StepLR, all built here, none named in a
config. Each forward sleeps 0.1 s (no CPU), so that chaos events at step
numbers land mid-run on any machine (as tests/paced_model.py does).
"""

from elastic_train.agent.warm_start import hand_over

hand_over(__file__)  # before torch: a warm start when the agent runs a zygote

import os  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from elastic_train.api import fit  # noqa: E402

SAMPLES = 96
FEATURES = 8
CLASSES = 4
#: The fault-free reference run sets 0: a sleep does not change the arithmetic.
SECONDS_PER_FORWARD = float(os.environ.get("FIT_SCRIPT_SECONDS_PER_FORWARD", "0.1"))
#: Where set, a file whose number of seconds replaces SECONDS_PER_FORWARD from the
#: next forward on: the test ends the pause once its faults have played out.
PAUSE_FILE = os.environ.get("FIT_SCRIPT_PAUSE_FILE")


def _pause_seconds() -> float:
    if PAUSE_FILE:
        try:
            with open(PAUSE_FILE) as file:
                return float(file.read())
        except (OSError, ValueError):
            pass
    return SECONDS_PER_FORWARD


class PacedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(_pause_seconds())
        return self.net(x)


def make_items() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    inputs = torch.randn(SAMPLES, FEATURES, generator=gen)
    targets = (inputs[:, :CLASSES] * torch.arange(1, CLASSES + 1)).argmax(dim=1)
    return [{"x": inputs[i], "y": targets[i]} for i in range(SAMPLES)]


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {"x": torch.stack([i["x"] for i in items]), "y": torch.stack([i["y"] for i in items])}


def loss_sum_count(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    logits = model(batch["x"])
    return nn.functional.cross_entropy(logits, batch["y"], reduction="sum"), len(batch["y"])


def two_groups(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
    )


def halve_every_30(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.5)


if __name__ == "__main__":
    torch.manual_seed(0)
    fit(
        model=PacedMLP(),
        dataset=make_items(),
        loss=loss_sum_count,
        optimizer=two_groups,
        scheduler=halve_every_30,
        collate_fn=collate,
        config={
            "model": {"loss_form": "sum_count"},
            "training": {"steps": 90, "global_batch_size": 16, "final_loss_samples": SAMPLES},
            "checkpoint": {"interval_steps": 4},
        },
    )
