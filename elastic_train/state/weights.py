"""Model weights in and out of a run: ``checkpoint.init_from``, ``checkpoint.resume_from``,
``checkpoint.export_dir``.

- :func:`read_weights` reads a state dict (weights only: no optimizer, no
  step) from our checkpoint (one step directory, or a checkpoint directory:
  its newest complete step), a ``.safetensors`` file, a plain ``state_dict``
  file (``torch.save``, loaded with ``weights_only=True``), or a Hugging Face
  model directory (``model.safetensors``, ``pytorch_model.bin`` or their
  sharded ``*.index.json``).
- :func:`check_weights` compares them with a model's own state dict and raises
  a :class:`ConfigError` naming ``checkpoint.init_from`` and the first
  mismatching names and shapes: a checkpoint of another model is refused
  before training starts.
- :func:`resume_checkpoint` resolves ``checkpoint.resume_from`` (one step
  directory with its completion marker).
- :func:`export_weights` writes the final weights as ``model.safetensors`` and
  ``model.pt``, each atomically (temporary file, fsync, rename).

``safetensors`` is imported where it is used: a worker that does not touch
these files does not pay for the import.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from elastic_train.errors import CheckpointCorruptError, CheckpointWriteError, ConfigError
from elastic_train.log import get_logger
from elastic_train.state.checkpoint_files import MANIFEST, load_state, read_manifest
from elastic_train.state.state_io import fsync_path

log = get_logger(__name__)

SAFETENSORS_FILE = "model.safetensors"
STATE_DICT_FILE = "model.pt"
#: A Hugging Face model directory's weight files, in the order they are tried.
HF_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
#: Wrappers whose prefix a saved state dict may carry on every key (DDP, torch.compile).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_STEP_DIR = re.compile(r"^step-(\d+)$")
#: Mismatching names and shapes an error lists before "...".
_SHOWN = 5

Weights = dict[str, torch.Tensor]


# -- reading --------------------------------------------------------------------


def read_weights(source: str, *, key: str = "checkpoint.init_from") -> Weights:
    """The tensors of ``source`` on the CPU, keyed by parameter/buffer name.

    ``key`` names the config key in every error.
    """
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(f"{key} = {source!r}: no such file or directory")
    if path.is_dir():
        weights = _read_directory(path, key=key, source=source)
    elif path.suffix == ".safetensors":
        weights = _read_safetensors(path, key=key)
    else:
        weights = _state_dict_of(_torch_load(path, key=key), key=key, source=source)
    return _strip_wrapper_prefix(weights)


def _read_directory(path: Path, *, key: str, source: str) -> Weights:
    if (path / MANIFEST).exists() or _STEP_DIR.match(path.name):
        return _state_dict_of(_read_ours(path, key=key), key=key, source=source)
    steps = complete_steps(path)
    if steps:
        return _state_dict_of(_read_ours(steps[0][1], key=key), key=key, source=source)
    for name in HF_FILES:
        if (path / name).is_file():
            return _read_hf(path / name, key=key)
    raise ConfigError(
        f"{key} = {source!r}: a directory without weights; expected one of our checkpoint "
        f"directories (step-*/{MANIFEST}) or a Hugging Face model directory "
        f"({', '.join(HF_FILES)})"
    )


def complete_steps(directory: Path) -> list[tuple[int, Path]]:
    """Step directories under ``directory`` that hold a completion marker, newest first."""
    found = []
    for child in directory.iterdir() if directory.is_dir() else ():
        match = _STEP_DIR.match(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


def _read_ours(step_dir: Path, *, key: str) -> Any:
    """Our checkpoint, verified (manifest and checksum) before anything is unpickled."""
    match = _STEP_DIR.match(step_dir.name)
    if match is None or not (step_dir / MANIFEST).is_file():
        raise ConfigError(
            f"{key} = {str(step_dir)!r}: no {MANIFEST} (its completion marker): the save "
            "never completed; name a complete step directory"
        )
    try:
        body = read_manifest(step_dir, int(match.group(1)))
        return load_state(step_dir, body, map_location="cpu")
    except CheckpointCorruptError as exc:
        raise ConfigError(f"{key} = {str(step_dir)!r}: unusable checkpoint: {exc}") from exc


def _read_safetensors(path: Path, *, key: str) -> Weights:
    safetensors_torch = _safetensors(key)
    try:
        return dict(safetensors_torch.load_file(str(path), device="cpu"))
    except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
        raise ConfigError(
            f"{key} = {str(path)!r}: not a readable safetensors file ({exc})"
        ) from exc


def _torch_load(path: Path, *, key: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError for forbidden types, RuntimeError, ...
        raise ConfigError(
            f"{key} = {str(path)!r}: not a state_dict file that torch.load(weights_only=True) "
            f"accepts ({exc})"
        ) from exc


def _read_hf(path: Path, *, key: str) -> Weights:
    """One Hugging Face weight file, or every shard that its index names."""
    reader: Callable[[Path], Any] = (
        (lambda p: _read_safetensors(p, key=key))
        if ".safetensors" in path.name
        else (lambda p: _torch_load(p, key=key))
    )
    if not path.name.endswith(".index.json"):
        return _state_dict_of(reader(path), key=key, source=str(path))
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{key} = {str(path)!r}: unreadable shard index ({exc})") from exc
    weights: Weights = {}
    for shard in shards:
        weights.update(_state_dict_of(reader(path.parent / shard), key=key, source=shard))
    return weights


def _state_dict_of(loaded: Any, *, key: str, source: str) -> Weights:
    """The name -> tensor mapping inside what was loaded: a full training state
    (ours: its ``"model"``) or a plain state dict."""
    if isinstance(loaded, Mapping) and isinstance(loaded.get("model"), Mapping):
        loaded = loaded["model"]
    if not isinstance(loaded, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise ConfigError(
            f"{key} = {source!r}: holds no state dict (a mapping of names to tensors, or a "
            "training state with one under 'model')"
        )
    return dict(loaded)


def _strip_wrapper_prefix(weights: Weights) -> Weights:
    for prefix in _WRAPPER_PREFIXES:
        if weights and all(name.startswith(prefix) for name in weights):
            weights = {name[len(prefix) :]: tensor for name, tensor in weights.items()}
    return weights


def _safetensors(key: str) -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ConfigError(
            f"{key} needs the safetensors package (a dependency of elastic-train: "
            "pip install safetensors)"
        ) from exc
    return safetensors.torch


# -- checking and loading into a model ------------------------------------------


def check_weights(model: torch.nn.Module, weights: Weights, *, source: str) -> None:
    """Raise a ConfigError naming ``checkpoint.init_from`` unless ``weights`` has exactly
    the model's names with the model's shapes (dtypes are converted on load)."""
    own = model.state_dict()
    missing = [name for name in own if name not in weights]
    unexpected = [name for name in weights if name not in own]
    shapes = [
        f"{name}: checkpoint {list(weights[name].shape)}, model {list(tensor.shape)}"
        for name, tensor in own.items()
        if name in weights and weights[name].shape != tensor.shape
    ]
    problems = [
        f"{label} ({len(items)}): {', '.join(items[:_SHOWN])}"
        + (", ..." if len(items) > _SHOWN else "")
        for label, items in (
            ("shape mismatch", shapes),
            ("missing in the checkpoint", missing),
            ("not in the model", unexpected),
        )
        if items
    ]
    if problems:
        raise ConfigError(
            f"checkpoint.init_from = {source!r}: the weights of another model; "
            + "; ".join(problems)
            + " (accepted: a checkpoint, safetensors or state_dict file of this model.name "
            "and its options)"
        )


def init_weights(model: torch.nn.Module, source: str) -> None:
    """Load the weights of ``source`` into ``model`` (checked first); nothing else."""
    weights = read_weights(source)
    check_weights(model, weights, source=source)
    with torch.no_grad():
        model.load_state_dict(weights, strict=True)
    log.info("init_from_loaded", source=source, tensors=len(weights))


# -- resume_from ----------------------------------------------------------------


def resume_checkpoint(source: str) -> tuple[Path, int]:
    """``(checkpoint directory, step)`` of the step directory ``checkpoint.resume_from``
    names; a ConfigError when it is missing or incomplete."""
    key = "checkpoint.resume_from"
    path = Path(source).expanduser()
    match = _STEP_DIR.match(path.name)
    if not path.is_dir():
        raise ConfigError(f"{key} = {source!r}: no such checkpoint directory")
    if match is None:
        steps = ", ".join(p.name for _, p in complete_steps(path)[:3]) or "none here"
        raise ConfigError(
            f"{key} = {source!r}: name one step directory (step-NNNNNNNNN) of a checkpoint "
            f"directory; complete ones here, newest first: {steps}"
        )
    if not (path / MANIFEST).is_file():
        raise ConfigError(
            f"{key} = {source!r}: no {MANIFEST} (its completion marker): the save never "
            "completed; name a complete step directory"
        )
    return path.parent, int(match.group(1))


# -- export ---------------------------------------------------------------------


def export_weights(
    weights: Mapping[str, torch.Tensor], directory: str | Path,
    *, key: str = "checkpoint.export_dir",
) -> list[Path]:  # fmt: skip
    """Write ``model.safetensors`` and ``model.pt`` (a plain state dict) into
    ``directory``, each atomically; returns their paths. ``key`` names the
    setting in every error."""
    target = Path(directory)
    tensors = _unshared({k: v.detach().cpu().contiguous() for k, v in weights.items()})
    safetensors_torch = _safetensors(key)
    try:
        target.mkdir(parents=True, exist_ok=True)
        written = [
            _write_atomically(
                target / SAFETENSORS_FILE, lambda p: safetensors_torch.save_file(tensors, p)
            ),
            _write_atomically(target / STATE_DICT_FILE, lambda p: torch.save(tensors, p)),
        ]
        fsync_path(target)
    except OSError as exc:
        raise CheckpointWriteError(
            f"{key} = {str(directory)!r}: exporting the weights failed: {exc.strerror or exc}"
        ) from exc
    return written


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied tensors (one storage, two names) copied apart: safetensors refuses
    shared storage, and a state dict loads either way."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen and tensor.numel() else tensor
        seen.add(pointer)
    return out


def _write_atomically(final: Path, write: Callable[[str], None]) -> Path:
    temporary = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(str(temporary))
        with open(temporary, "rb") as file:
            os.fsync(file.fileno())
        os.replace(temporary, final)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return final
