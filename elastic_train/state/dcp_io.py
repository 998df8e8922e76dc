"""What a sharded (DCP) checkpoint holds, and reading it without unsafe unpickling.

``torch.distributed.checkpoint`` unpickles two things with plain ``pickle``:
its ``.metadata`` file, and every non-tensor value (``torch.load`` with
``weights_only=False``). So:

* only tensors go through DCP (:func:`split_tensors`): the rest of the state
  (the optimizer's param_groups, the sampler, RNG states, ...) is rank 0's
  ``state.pt``, checksummed and loaded with ``weights_only=True`` like a DDP
  checkpoint's;
* ``.metadata`` is read by :class:`VerifiedReader` through an unpickler that
  builds only DCP's own metadata classes, ``torch.Size`` and dtypes, and
  refuses any other global, naming it.

Also here: the manifest of a sharded checkpoint (:func:`read_dcp_manifest`)
and the checksums of its files, verified by the ranks together
(:func:`verify_files`) before DCP reads any of them.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from elastic_train.errors import CheckpointCorruptError, CheckpointMismatchError
from elastic_train.state.checkpoint_files import (
    MANIFEST,
    STATE_FILE,
    checksum_file,
    manifest_checksum,
)

#: The manifest format of a sharded checkpoint (``sharded.py``).
FORMAT = "elastic_train.dcp/1"
#: In the skeleton of ``state.pt``: where a tensor saved through DCP goes back.
TENSOR_MARK = "__elastic_train.dcp_tensor__"
_METADATA_FILE = ".metadata"
#: Globals a DCP ``.metadata`` pickle may name, besides its own metadata module.
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = module == _METADATA_MODULE or (module, name) in _ALLOWED_GLOBALS
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise CheckpointCorruptError(
                f"DCP metadata names {module}.{name}, which is not a checkpoint metadata type"
            )
        return super().find_class(module, name)


class VerifiedReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = Path(str(self.path)) / _METADATA_FILE
        try:
            with open(path, "rb") as file:
                metadata = _MetadataUnpickler(file).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as exc:
            raise CheckpointCorruptError(f"{path}: unreadable DCP metadata ({exc})") from exc
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


def split_tensors(tree: Any, path: list[Any], tensors: dict[str, torch.Tensor]) -> Any:
    """``tree`` with each tensor replaced by a mark naming it; the tensors go into
    ``tensors`` under a key made of their path (JSON, so dotted FQNs stay apart)."""
    if isinstance(tree, torch.Tensor):
        key = json.dumps(path)
        tensors[key] = tree
        return {TENSOR_MARK: key}
    if isinstance(tree, dict):
        return {k: split_tensors(v, [*path, k], tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [split_tensors(v, [*path, i], tensors) for i, v in enumerate(tree)]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def marked_keys(skeleton: Any) -> set[str]:
    """The tensor keys a skeleton of :func:`split_tensors` refers to."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {TENSOR_MARK}:
            return {skeleton[TENSOR_MARK]}
        return set().union(*(marked_keys(v) for v in skeleton.values()))
    if isinstance(skeleton, (list, tuple)):
        return set().union(*(marked_keys(v) for v in skeleton))
    return set()


def fill_tensors(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {TENSOR_MARK}:
            return tensors[skeleton[TENSOR_MARK]]
        return {k: fill_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        items = [fill_tensors(v, tensors) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    return skeleton


def key_difference(saved: set[str], expected: set[str], *, limit: int = 3) -> str:
    """A short description of how two sets of tensor keys differ, for an error."""
    missing = sorted(expected - saved)[:limit]
    unexpected = sorted(saved - expected)[:limit]
    names = [json.loads(k) for k in missing], [json.loads(k) for k in unexpected]
    return f"missing {names[0]}, unexpected {names[1]}"


def read_dcp_manifest(directory: Path, step: int) -> dict[str, Any]:
    """The verified manifest body of a DCP checkpoint directory."""
    try:
        document = json.loads((directory / MANIFEST).read_bytes())
        body = document["body"]
        valid = document["sha256"] == manifest_checksum(body)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        message = f"{directory / MANIFEST}: unreadable manifest ({exc})"
        raise CheckpointCorruptError(message) from exc
    if valid and body.get("format") != FORMAT:
        raise CheckpointMismatchError(
            f"{directory} is a {body.get('format')!r} checkpoint (training.parallel = 'ddp'); "
            "a training.parallel = 'fsdp2' job reads only its own DCP checkpoints: use a new "
            "checkpoint.dir, or parallel = 'ddp'"
        )
    if not valid or body.get("step") != step or STATE_FILE not in body.get("files", {}):
        raise CheckpointCorruptError(f"{directory / MANIFEST}: manifest fails its checksum")
    return body


def shared_token(group: dist.ProcessGroup) -> str:
    """Rank 0's random token, the same on every rank: names the temporary directories.
    Drawn from the OS, not torch's generator, which would shift the training's RNG."""
    drawn = int.from_bytes(os.urandom(4), "little") if dist.get_rank() == 0 else 0
    token = torch.tensor([drawn], dtype=torch.int64)
    dist.broadcast(token, src=0, group=group)
    return f"{int(token.item()):08x}"


def verify_files(path: Path, body: dict[str, Any], group: dist.ProcessGroup) -> None:
    """Checksums of every file of a checkpoint, each rank of ``group`` a share;
    all ranks agree (one all-reduce), so a damaged file fails the load everywhere."""
    names = sorted(body["files"])
    mine = names[dist.get_rank(group) :: dist.get_world_size(group)]
    bad = ""
    for name in mine:
        try:
            size, crc = checksum_file(path / name)
        except OSError as exc:
            bad = f"{name}: unreadable ({exc})"
            break
        entry = body["files"][name]
        if size != entry["bytes"] or crc != entry["crc32"]:
            bad = f"{name}: crc32 or size does not match the manifest"
            break
    failed = torch.tensor([1 if bad else 0])
    dist.all_reduce(failed, group=group)
    if bad or int(failed.item()):
        raise CheckpointCorruptError(f"{path}: {bad or 'a file failed its check on a peer'}")
