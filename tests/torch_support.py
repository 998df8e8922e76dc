"""Skips for tests of features the installed torch lacks (``bash .ci/torch-floor`` runs 2.6).

Each reason is the product's own check, so a skip here is exactly a refusal there.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from elastic_train.config.checks import FSDP2_MIN_TORCH, torch_release
from elastic_train.training.recovery_mode import torch_reason

_TORCH = importlib.metadata.version("torch")

#: in-process recovery (elastic.recovery = "inprocess", or "auto" expected to run it)
needs_inprocess = pytest.mark.skipif(
    torch_reason() is not None, reason=f"in-process recovery: {torch_reason()}"
)
#: training.parallel = "fsdp2"
needs_fsdp2 = pytest.mark.skipif(
    torch_release(_TORCH) < FSDP2_MIN_TORCH,
    reason=f"FSDP2 needs torch >= 2.7 (installed: {_TORCH})",
)
