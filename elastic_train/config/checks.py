"""The checks that the job configuration's sections run in ``__post_init__``
(``config/job.py``), and the small parsers they share with the trainer: each
failure is a :class:`~elastic_train.errors.ConfigError` naming ``section.key``,
its value and what is accepted."""

from __future__ import annotations

import importlib.metadata
import re
import signal
from typing import TYPE_CHECKING, Any

from elastic_train.errors import ConfigError

if TYPE_CHECKING:
    from elastic_train.config.job import TrainingConfig

__all__ = [
    "FSDP2_MIN_TORCH",
    "builtin_or_import_string",
    "check",
    "check_fsdp2",
    "parse_signal",
    "positive",
    "torch_release",
]


def check(component: Any, key: str, ok: bool, message: str) -> None:
    if not ok:
        value = getattr(component, key)
        raise ConfigError(f"{component.SECTION}.{key} = {value!r}: {message}")


def positive(component: Any, *keys: str) -> None:
    for key in keys:
        check(component, key, getattr(component, key) > 0, "must be > 0")


def builtin_or_import_string(component: Any, key: str, builtins: tuple[str, ...]) -> None:
    value = getattr(component, key)
    names = ", ".join(repr(name) for name in builtins)
    check(component, key, value in builtins or ":" in value,
          f"use one of {names} or an import string package.module:factory")  # fmt: skip


#: The oldest torch whose fully_shard runs on CPU: torch 2.6's fails at the first
#: forward ("'Stream' object has no attribute 'record_event'", measured here).
FSDP2_MIN_TORCH = (2, 7)


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.10.0a0+git1" -> (2, 10)."""
    major, minor = (int(part) for part in re.findall(r"\d+", version)[:2])
    return major, minor


def check_fsdp2(cfg: TrainingConfig) -> None:
    """What ``parallel = "fsdp2"`` cannot combine with; read without importing torch."""
    also = "with training.parallel = 'fsdp2'"
    check(cfg, "comm_hook", cfg.comm_hook == "none",
          f"DDP communication hooks do not apply {also}; use 'none'")  # fmt: skip
    check(cfg, "precision", cfg.precision != "fp16",
          f"fp16's GradScaler checks for inf per rank, which a sharded gradient "
          f"cannot agree on {also}; use 'bf16' or 'fp32'")  # fmt: skip
    check(cfg, "compile", not cfg.compile, f"torch.compile is not supported {also} yet")
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return  # torch's own import error says more
    check(cfg, "parallel", torch_release(version) >= FSDP2_MIN_TORCH,
          f"needs torch >= {'.'.join(map(str, FSDP2_MIN_TORCH))} "
          f"(installed: {version}); use 'ddp' or upgrade torch")  # fmt: skip


def parse_signal(name: str) -> signal.Signals:
    """``"SIGUSR1"``, ``"USR1"`` or ``"10"`` -> ``signal.SIGUSR1``."""
    text = name.strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError) as exc:
        raise ConfigError(
            f"elastic.preemption_signal = {name!r} is not a signal name; "
            "use e.g. SIGUSR1, SIGUSR2, SIGINT"
        ) from exc
