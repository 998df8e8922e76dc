"""A module for the zygote's ``preload`` setting (tests/test_warm_start.py).

At import it appends the importing process's pid to ``PRELOAD_PROBE_FILE``, so
a test sees which process imported it, and how often. ``PRELOAD_PROBE_THREAD``
makes the import start a thread, as a library with a background pool would;
``PRELOAD_PROBE_CUDA`` makes it initialise CUDA.
Used as ``--model.name=tests.preload_probe:model``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from torch import nn

from elastic_train.config.job import ModelConfig
from elastic_train.workload.models import mlp

if os.environ.get("PRELOAD_PROBE_FILE"):
    with open(os.environ["PRELOAD_PROBE_FILE"], "a") as record:
        record.write(f"{os.getpid()}\n")
if os.environ.get("PRELOAD_PROBE_THREAD"):
    threading.Thread(target=threading.Event().wait, daemon=True).start()
if os.environ.get("PRELOAD_PROBE_CUDA"):  # tests/test_cuda.py
    import torch

    torch.cuda.init()


def model(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    """The registry's ``mlp``."""
    return mlp(cfg, info)
