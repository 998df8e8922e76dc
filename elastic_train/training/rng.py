"""Capture and restore every random number generator a training step touches.

The captured state holds only tensors, ints, floats, strings, lists and dicts,
so it travels inside a checkpoint that loads with ``torch.load(weights_only=True)``
and inside a shared-memory snapshot. Each generator is optional on restore: a
state saved on a CUDA machine restores on a CPU-only one (the CUDA part is
skipped) and vice versa, because only torch's CPU generator, Python's and
NumPy's decide what a CPU run computes.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:  # NumPy is optional at run time; the trainer does not need it.
    import numpy as np
except ImportError:  # pragma: no cover - exercised only without numpy
    np = None  # type: ignore[assignment]

from elastic_train.log import get_logger

log = get_logger(__name__)


def capture_torch_rng_state() -> dict[str, Any]:
    """The part a training step draws from: torch's CPU and CUDA generators (about 1 µs).

    Python's and NumPy's states take 35 µs more; the step rewind of
    ``snapshot_on_failure`` captures only this part at each step's start.

    CUDA's generators only once this process initialised CUDA: reading them
    initialises it, and a gloo worker on a GPU host (``elastic-train local``
    with more nodes than GPUs) would hold a CUDA context on GPU 0 for nothing.
    A process that never initialised CUDA never drew from them either, so
    their seeded start is all there is to restore.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def capture_rng_state() -> dict[str, Any]:
    """The state of torch (CPU and every CUDA device), Python ``random`` and NumPy."""
    version, internal, gauss_next = random.getstate()
    state = capture_torch_rng_state()
    # One tensor rather than a list of 625 ints: cheaper to copy and serialize.
    # NumPy builds it in 10 µs, torch.tensor from the tuple in 30 µs.
    ints = (
        torch.from_numpy(np.array(internal, dtype=np.int64))
        if np is not None
        else torch.tensor(internal, dtype=torch.int64)
    )
    state["python"] = {"version": version, "state": ints, "gauss_next": gauss_next}
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` captured; absent parts are left alone."""
    torch.set_rng_state(state["torch"].cpu())
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
        else:
            # A different GPU count means a different job shape; per-device streams
            # cannot be mapped one to one, so keep the fresh ones and say so.
            log.warning(
                "rng_cuda_state_skipped",
                saved_devices=len(cuda),
                devices=torch.cuda.device_count(),
            )
    numpy_state = state.get("numpy")
    if numpy_state is not None and np is not None:
        np.random.set_state(
            (
                numpy_state["kind"],
                numpy_state["keys"].cpu().numpy().astype(np.uint32),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
