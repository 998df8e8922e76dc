"""Snapshot encoding: exact round trips while the cached structure is reused or rebuilt."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.errors import CheckpointError, SnapshotError
from elastic_train.state.snapshot import SnapshotStore
from elastic_train.state.snapshot_layout import MAGIC, SlotEncoder
from elastic_train.state.state_io import flatten_state, shape_to_json, unflatten_state


@pytest.fixture
def store() -> Iterator[SnapshotStore]:
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    snapshot = SnapshotStore(f"test-{uuid.uuid4().hex[:12]}", fingerprint="fp", root=root)
    yield snapshot
    snapshot.remove()


def _assert_exact(got: Any, want: Any) -> None:
    """Equal values of equal types, recursively: 1, 1.0 and True are three different states."""
    assert type(got) is type(want), (got, want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    elif isinstance(want, dict):
        assert [(type(k), repr(k)) for k in got] == [(type(k), repr(k)) for k in want]
        for key in want:
            _assert_exact(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_exact(g, w)
    elif isinstance(want, float) and want != want:
        assert got != got  # NaN
    else:
        assert got == want and repr(got) == repr(want)


def _round_trip(store: SnapshotStore, step: int, state: dict) -> None:
    store.save(step, state)
    loaded_step, loaded = store.load(map_location="cpu")
    assert loaded_step == step
    _assert_exact(loaded, state)


def test_adam_state_appearing_after_the_first_step_is_saved_exactly(store: SnapshotStore) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def state(step: int) -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}

    _round_trip(store, 0, state(0))  # no optimizer state yet: {"state": {}}
    for step in range(1, 4):  # step 1 adds step/exp_avg/exp_avg_sq per parameter
        optimizer.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        _round_trip(store, step, state(step))
        assert len(store.load(map_location="cpu")[1]["optimizer"]["state"]) == 4


def test_the_cached_structure_is_reused_only_while_it_is_unchanged(store: SnapshotStore) -> None:
    encoder = SlotEncoder("fp")
    first = encoder.encode({"w": torch.zeros(3), "lr": 0.1, "step": 1})
    same = encoder.encode({"w": torch.ones(3), "lr": 0.2, "step": 2})
    assert same.table is first.table  # steady state: only the scalars are encoded
    for changed in (
        {"w": torch.zeros(4), "lr": 0.1, "step": 1},  # a tensor's shape
        {"w": torch.zeros(3, dtype=torch.float64), "lr": 0.1, "step": 1},  # its dtype
        {"w": torch.zeros(3), "lr": 0.1, "step": 1, "new": 0},  # a key appears
    ):
        assert encoder.encode(changed).table is not same.table
        same = encoder.encode(changed)
    # Same keys, tensors and scalars, another nesting: only the tokens tell them apart.
    for step, nesting in enumerate(([1, 2], (1, 2), [1, [2]], [[1], 2]), start=1):
        _round_trip(store, step, {"w": torch.zeros(1), "x": nesting})
    # Scalars whose value changes type keep the structure and round-trip exactly.
    for step, value in enumerate((1, 1.0, True, None, "1", float("inf"), float("nan")), start=1):
        _round_trip(store, step, {"w": torch.full((2,), float(step)), "value": value})


def test_keys_that_compare_equal_but_differ_in_type_are_never_confused(
    store: SnapshotStore,
) -> None:
    # 1 == 1.0 == True and 0.0 == -0.0: a cache keyed on == would return the previous key.
    for step, key in enumerate((1, True, 1.0, 0.0, -0.0, 0, False, "1"), start=1):
        _round_trip(store, step, {"state": {key: torch.tensor([float(step)])}, "step": step})


def test_rare_shapes_round_trip_exactly(store: SnapshotStore) -> None:
    tied = torch.randn(4)
    state = {
        "tied": [tied, {"again": tied}],
        "tuple_keys": {(1, "a"): 2, (3,): torch.arange(3)},
        "odict": OrderedDict([("b", 1), ("a", (2.5, None))]),
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "bytes": b"\x00\xffraw",
        "empty": ({}, [], ()),
        "transposed": torch.arange(6.0).view(2, 3).t(),
    }
    for step in (1, 2):  # the second save goes through the cached structure
        _round_trip(store, step, state)
    loaded = store.load(map_location="cpu")[1]
    assert loaded["tied"][0] is loaded["tied"][1]["again"]


def test_flatten_is_the_inverse_of_unflatten_after_json() -> None:
    state = {"a": [1, {"b": torch.ones(2)}], "c": (torch.Size([1]), torch.int8)}
    flat = flatten_state(state)
    _assert_exact(
        unflatten_state(shape_to_json(flat.shape), flat.keys, flat.leaves, flat.tensors), state
    )
    with pytest.raises(CheckpointError, match="truncated"):
        unflatten_state(shape_to_json(flat.shape), flat.keys, flat.leaves[:-1], flat.tensors)
    with pytest.raises(CheckpointError, match="left over"):
        unflatten_state(shape_to_json(flat.shape), [*flat.keys, "x"], flat.leaves, flat.tensors)


def test_an_unsupported_value_is_named_by_its_path(store: SnapshotStore) -> None:
    store.save(1, {"w": torch.zeros(2)})
    with pytest.raises(SnapshotError, match=r"state\['opt'\]\['groups'\]\[1\] is a object"):
        store.save(2, {"opt": {"groups": [1, object()]}})
    with pytest.raises(SnapshotError, match=r"state\['k'\] key is a frozenset"):
        store.save(2, {"k": {frozenset(): 1}})
    assert store.load(map_location="cpu")[0] == 1


def test_a_slot_of_another_format_version_is_not_used(store: SnapshotStore) -> None:
    store.save(1, {"w": torch.zeros(2)})
    store.save(2, {"w": torch.ones(2)})
    for slot in (0, 1):
        path = store.directory / f"slot-{slot}"
        data = bytearray(path.read_bytes())
        data[: len(MAGIC)] = b"ETSNAP4\n"
        path.write_bytes(bytes(data))
    assert store.load(map_location="cpu") is None
