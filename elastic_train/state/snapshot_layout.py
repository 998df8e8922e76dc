"""The bytes of one snapshot slot: layout, header, checksum, and the per-save encoding.

A slot is ``[4 KiB header][tensor bytes][blob]``. The blob is JSON of the
tensor table, the state's structure (:func:`state_io.flatten_state` tokens),
its dict keys and its scalar values, so a snapshot costs one memcpy per
tensor rather than a full serialization, and reading one back never unpickles
anything.

The structure of a training state is the same after every optimizer step;
only scalars (step, learning rate, RNG positions) and tensor contents change.
:class:`SlotEncoder` therefore keeps everything derived from the structure
(tensor table, JSON of table, tokens and keys) and, while a save's structure
compares equal to the previous one, encodes only the scalar values. Equality
is exact: tokens are markers, counts and tensor indices; keys are compared
with their types, and float keys (where ``0.0 == -0.0``) are never cached.

The checksum is the wrapping sum of the slot's 64-bit words: one vectorized
pass over the state, about 10x cheaper than crc32, which a per-step snapshot
on a small model cannot afford (crc32 alone was 5 % of a 3 ms step). It
detects what it is for, a slot that mixes bytes of two saves or was damaged
afterwards; the header-last order is what keeps a torn slot from being used.
The header carries a crc32 of itself (its last 9 bytes), so a flipped bit in
the step, the sizes or the fingerprint is seen as damage, never trusted.

:func:`pack` and :func:`unpack` use the same layout for a state in memory: a
restore ships a state to the ranks that lack it in this form, so no peer's
bytes are ever unpickled (``restore.broadcast_state``).
"""

from __future__ import annotations

import json
import mmap
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from elastic_train.errors import CheckpointError, SnapshotError
from elastic_train.state.state_io import (
    dtype_from_name,
    flatten_state,
    shape_to_json,
    unflatten_state,
)

HEADER_BYTES = 4096
MAGIC = b"ETSNAP6\n"  # 6: the header's own crc32; 5: structure tokens + keys + leaves
ALGORITHM = "sum64"
_ALIGN = 64
#: The header ends with b"\n" and the crc32 of everything before it, as 8 hex digits.
_HEADER_CRC = 9


def aligned(n: int, align: int = _ALIGN) -> int:
    return -(-n // align) * align


def sum64(region: torch.Tensor) -> str:
    """The wrapping sum of the 64-bit words of a uint8 region (its length a multiple of 8)."""
    total = int(region.view(torch.int64).sum().item())
    return f"{total & 0xFFFFFFFFFFFFFFFF:016x}"


def slot_end(data_bytes: int, blob_bytes: int) -> int:
    """Where a slot's checksummed bytes end: the blob is zero-padded to whole words."""
    return HEADER_BYTES + data_bytes + aligned(blob_bytes, 8)


class Encoded(NamedTuple):
    blob: bytes
    tensors: list[torch.Tensor]
    table: list[list[Any]]  # [dtype, shape, offset into the tensor bytes, nbytes]; reused
    data_bytes: int  # the tensor bytes, aligned; the blob follows them


class _Plan(NamedTuple):
    """What a save derives from the state's structure, reused while it is unchanged."""

    shape: list[Any]
    kinds: list[tuple[torch.dtype, torch.Size]]  # dtype and shape of each tensor
    keys: list[Any]
    key_types: list[type]
    table: list[list[Any]]
    prefix: bytes  # the blob up to the scalar values
    data_bytes: int


class SlotEncoder:
    """Encodes states into slot bytes, caching the structure-derived parts (see module doc)."""

    def __init__(self, fingerprint: str) -> None:
        self._plan: _Plan | None = None
        self._header_tail = f', "{ALGORITHM}": "%s", "fingerprint": {json.dumps(fingerprint)}}}'

    def encode(self, state: dict) -> Encoded:
        try:
            flat = flatten_state(state)
        except CheckpointError as exc:
            raise SnapshotError(str(exc)) from exc
        kinds = [(tensor.dtype, tensor.shape) for tensor in flat.tensors]
        key_types = list(map(type, flat.keys))
        plan = self._plan
        if (
            plan is None
            or flat.shape != plan.shape
            or kinds != plan.kinds
            or flat.keys != plan.keys
            or key_types != plan.key_types
            or float in key_types
        ):
            plan = self._plan = _make_plan(flat.shape, kinds, flat.keys, key_types)
        blob = plan.prefix + json.dumps(flat.leaves).encode() + b"}"
        return Encoded(blob, flat.tensors, plan.table, plan.data_bytes)

    def header(self, step: int, encoded: Encoded, digest: str) -> bytes:
        """The slot's header; its fields are JSON so a reader needs no format of its own."""
        fields = f'{{"step": {step}, "data_bytes": {encoded.data_bytes}, '
        fields += f'"blob_bytes": {len(encoded.blob)}' + self._header_tail % digest
        header = MAGIC + fields.encode()
        if len(header) > HEADER_BYTES - _HEADER_CRC:
            raise SnapshotError(f"snapshot header too long ({len(header)} bytes)")
        body = header.ljust(HEADER_BYTES - _HEADER_CRC, b" ")
        return body + _crc_line(body)


def _crc_line(body: bytes) -> bytes:
    """The last ``_HEADER_CRC`` bytes of a header whose other bytes are ``body``."""
    return f"\n{zlib.crc32(body):08x}".encode()


def _make_plan(
    shape: list[Any],
    kinds: list[tuple[torch.dtype, torch.Size]],
    keys: list[Any],
    key_types: list[type],
) -> _Plan:
    table, offset = [], 0
    for dtype, size in kinds:
        nbytes = size.numel() * dtype.itemsize
        table.append([str(dtype).removeprefix("torch."), list(size), offset, nbytes])
        offset = aligned(offset + nbytes)
    prefix = (
        f'{{"table": {json.dumps(table)}, "shape": {json.dumps(shape_to_json(shape))}, '
        f'"keys": {json.dumps(keys)}, "leaves": '
    )
    return _Plan(shape, kinds, keys, key_types, table, prefix.encode(), offset)


def parse_header(raw: Any) -> tuple[dict[str, Any], int, str]:
    """(fields, end of the checksummed bytes, checksum) of a slot whose magic is present.

    Raises ValueError, KeyError or TypeError for a header that is damaged or not ours.
    """
    body = bytes(raw[: HEADER_BYTES - _HEADER_CRC])
    if bytes(raw[HEADER_BYTES - _HEADER_CRC : HEADER_BYTES]) != _crc_line(body):
        raise ValueError("the header fails its crc32 (a damaged header)")
    header = json.loads(body[len(MAGIC) :])
    return header, slot_end(header["data_bytes"], header["blob_bytes"]), header[ALGORITHM]


def verify(raw: Any, *, fingerprint: str, name: str) -> tuple[dict[str, Any], int]:
    """(header, end) of a slot's bytes (``raw``: a bytearray or mmap), once everything checks.

    Raises ``SnapshotError`` naming ``name`` and what is wrong: no or another
    format's magic, a damaged header, data that fails its checksum, another
    config's fingerprint.
    """
    if bytes(raw[: len(MAGIC)]) != MAGIC:
        if bytes(raw[: len(MAGIC) - 2]) == MAGIC[:-2]:  # ETSNAP<version>\n
            found = bytes(raw[: len(MAGIC)]).decode(errors="replace").strip()
            raise SnapshotError(
                f"{name}: format {found}, this version reads {MAGIC.decode().strip()}"
            )
        raise SnapshotError(f"{name}: no header (torn or never completed)")
    try:
        header, end, digest = parse_header(raw)
        step = header["step"]
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"{name}: unreadable header ({exc})") from exc
    if not isinstance(step, int) or len(raw) < end:
        raise SnapshotError(f"{name}: header does not match the data (step {step!r}, {end} bytes)")
    if sum64(torch.frombuffer(raw, dtype=torch.uint8)[HEADER_BYTES:end]) != digest:
        raise SnapshotError(f"{name}: data does not match its header (torn or damaged)")
    if header.get("fingerprint") != fingerprint:
        raise SnapshotError(
            f"{name}: written under config fingerprint {header.get('fingerprint')!r}, "
            f"this run's is {fingerprint!r}"
        )
    return header, end


def pack(state: dict, *, step: int, fingerprint: str) -> bytearray:
    """``state`` in a slot's layout, in memory: what :func:`unpack` reads back."""
    encoder = SlotEncoder(fingerprint)
    encoded = encoder.encode(state)
    blob_start = HEADER_BYTES + encoded.data_bytes
    end = slot_end(encoded.data_bytes, len(encoded.blob))
    raw = bytearray(end)
    region = torch.frombuffer(raw, dtype=torch.uint8)
    with torch.no_grad():
        torch._foreach_copy_(typed_views(region, encoded.table), encoded.tensors)
    raw[blob_start : blob_start + len(encoded.blob)] = encoded.blob
    raw[:HEADER_BYTES] = encoder.header(step, encoded, sum64(region[HEADER_BYTES:end]))
    return raw


def unpack(
    raw: Any, *, fingerprint: str, name: str, map_location: str | torch.device
) -> tuple[int, Any]:
    """``(step, state)`` of slot bytes, verified first; raises ``SnapshotError``."""
    header, _ = verify(raw, fingerprint=fingerprint, name=name)
    return header["step"], decode_checked(raw, header, name=name, map_location=map_location)


def decode_checked(
    raw: Any, header: dict[str, Any], *, name: str, map_location: str | torch.device
) -> Any:
    """:func:`decode` of verified bytes, its errors as ``SnapshotError`` naming ``name``."""
    try:
        return decode(raw, header, map_location=map_location)
    except (CheckpointError, ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
        raise SnapshotError(
            f"{name}: the state of step {header['step']} is unreadable: {exc}"
        ) from exc


def decode(raw: Any, header: dict[str, Any], *, map_location: str | torch.device) -> Any:
    """The state in a verified slot; raises CheckpointError and the errors of bad JSON."""
    blob_start = HEADER_BYTES + header["data_bytes"]
    document = json.loads(raw[blob_start : blob_start + header["blob_bytes"]])
    data = torch.frombuffer(raw, dtype=torch.uint8)[HEADER_BYTES:]
    tensors = [
        data[offset : offset + nbytes]
        .view(dtype_from_name(dtype))
        .view(shape)
        .to(map_location, copy=True)  # own storage: set_rng_state ignores view offsets
        for dtype, shape, offset, nbytes in document["table"]
    ]
    return unflatten_state(document["shape"], document["keys"], document["leaves"], tensors)


@dataclass
class SlotMapping:
    """One slot file, memory-mapped, with typed views for the current table."""

    mm: mmap.mmap
    region: torch.Tensor  # uint8 view of the whole mapping
    layout: list[list[Any]] | None = None  # the table ``targets`` were made for
    targets: list[torch.Tensor] | None = None  # typed views, one per tensor of the layout

    def targets_for(self, table: list[list[Any]]) -> list[torch.Tensor]:
        # The table is the same object from one step to the next (SlotEncoder
        # reuses it), so the views are built once and each save is one copy.
        if self.layout is not table or self.targets is None:
            self.targets = typed_views(self.region, table)
            self.layout = table
        return self.targets


def typed_views(region: torch.Tensor, table: list[list[Any]]) -> list[torch.Tensor]:
    """One view of ``region`` (a slot's bytes) per tensor of ``table``, typed and shaped."""
    return [
        region[HEADER_BYTES + offset : HEADER_BYTES + offset + nbytes]
        .view(dtype_from_name(dtype))
        .view(shape)
        for dtype, shape, offset, nbytes in table
    ]
