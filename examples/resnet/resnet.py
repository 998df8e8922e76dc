"""A torchvision ResNet-18 on synthetic images, augmented in 2 DataLoader
worker processes, with DDP and bf16 autocast (``local.toml``)::

    pip install -e ".[examples]"
    elastic-train local --config examples/resnet/local.toml
    elastic-train local --config examples/resnet/local.toml --nodes 3 \\
        --chaos kill:1@step20,join:1@step40

The workers import this module as ``examples.resnet.resnet``: run from a
checkout of this repository, or put the checkout on ``PYTHONPATH``.

The images are generated, not downloaded: 10 classes, each a fixed random
32x32 pattern plus noise, so the model has something to learn. A dataset
item is augmented (random crop with padding, horizontal flip) in
``__getitem__``, which runs in the DataLoader workers (``data.num_workers = 2``);
only the indices the sampler picks are ever loaded, so the exactly-once
audit holds (docs/training.md, "DataLoader workers"). The random
augmentations make the run differ from a fault-free one (as any augmented run
does), not the samples it sees.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic_train.config.job import DataConfig, ModelConfig
from elastic_train.errors import ConfigError
from elastic_train.workload.datasets import DataBundle

CLASSES = 10
SIZE = 32


def _torchvision(key: str):  # type: ignore[no-untyped-def]
    try:
        import torchvision
        import torchvision.models
        import torchvision.transforms.v2  # a submodule: not imported by the package
    except Exception as exc:  # ImportError, or a torchvision built for another torch
        raise ConfigError(
            f"{key} needs torchvision matching this torch ({torch.__version__}): "
            f'pip install -e ".[examples]" ({type(exc).__name__}: {exc})'
        ) from exc
    return torchvision


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """``count`` images of 10 classes: a fixed pattern per class plus noise, augmented."""

    def __init__(self, count: int, *, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.patterns = torch.rand(CLASSES, 3, SIZE, SIZE, generator=gen)
        self.labels = torch.randint(0, CLASSES, (count,), generator=gen)
        self.noise_seed = seed
        v2 = _torchvision("data.name").transforms.v2
        self.augment = v2.Compose([v2.RandomCrop(SIZE, padding=4), v2.RandomHorizontalFlip()])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = int(self.labels[index])
        noise = torch.randn(3, SIZE, SIZE, generator=torch.Generator().manual_seed(index))
        image = self.patterns[label] + 0.3 * noise  # the same image for an index, always
        return self.augment(image), label  # random: the worker's RNG, seeded by the DataLoader


def dataset(cfg: DataConfig) -> DataBundle:
    """``data.name = "examples.resnet.resnet:dataset"``: ``data.num_samples`` images."""
    images = SyntheticImages(cfg.num_samples, seed=cfg.seed)
    return DataBundle(images, {"num_classes": CLASSES})


def model(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    """``model.name = "examples.resnet.resnet:model"``: ResNet-18, stem for 32x32 inputs."""
    net = _torchvision("model.name").models.resnet18(num_classes=info["num_classes"])
    # The ImageNet stem (7x7 stride 2, then a max pool) would shrink 32x32 to 8x8 at once.
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


def no_decay_on_norms(net: nn.Module, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """``optimizer.name = "examples.resnet.resnet:no_decay_on_norms"``: SGD with
    weight decay on the conv and linear weights only, not on biases and norms."""
    decay = [p for p in net.parameters() if p.dim() > 1]
    no_decay = [p for p in net.parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay}]
    return torch.optim.SGD(groups, lr=lr, momentum=0.9, weight_decay=0.0, nesterov=True)
