"""Shared-memory snapshots: double buffering, torn writes, size bound, restore agreement."""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from workers import ForkedChild, start_workers

from elastic_train.errors import SnapshotError
from elastic_train.state.restore import (
    BROADCAST_PIECE_BYTES,
    RestoreDecision,
    broadcast_state,
    decide,
)
from elastic_train.state.snapshot import SnapshotStore
from elastic_train.state.snapshot_layout import HEADER_BYTES
from elastic_train.training.rng import capture_rng_state, restore_rng_state

FP = "fp-snap"


@pytest.fixture
def shm_root(tmp_path: Path) -> Path:
    """A private root: /dev/shm itself where it exists (the real tmpfs), else tmp_path."""
    if Path("/dev/shm").is_dir():
        return Path("/dev/shm")
    return tmp_path


@pytest.fixture
def store(shm_root: Path) -> Iterator[SnapshotStore]:
    snapshot = SnapshotStore(f"test-{uuid.uuid4().hex[:12]}", fingerprint=FP, root=shm_root)
    yield snapshot
    snapshot.remove()


def _state(step: int, numel: int = 1000) -> dict:
    return {"model": {"w": torch.full((numel,), float(step))}, "step": step}


def test_newest_snapshot_wins_and_the_directory_is_private(store: SnapshotStore) -> None:
    assert store.load(map_location="cpu") is None and store.latest_step() is None
    for step in (1, 2, 3):
        store.save(step, _state(step))
    step, state = store.load(map_location="cpu")
    assert step == 3 and torch.equal(state["model"]["w"], torch.full((1000,), 3.0))
    info = store.directory.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    assert sorted(p.name for p in store.directory.iterdir()) == ["HEAD", "LOCK", "slot-0", "slot-1"]
    store.remove()
    assert not store.directory.exists()


def test_every_kind_of_state_round_trips(store: SnapshotStore) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    tied = torch.randn(4, 4)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),  # int keys, tuples, floats, bools, None
        "tied": [tied, tied],
        "transposed": torch.arange(12.0).view(3, 4).t(),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 5),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(5).to(torch.bfloat16),
        "rng": torch.get_rng_state(),
        "meta": {"step": 4, "name": "x", "dtype": torch.float16},
        "generators": capture_rng_state(),
    }
    store.save(4, state)
    draws = (torch.rand(3), random.random(), np.random.rand())
    weight = state["model"]["weight"].clone()
    state["model"]["weight"].add_(1.0)  # the next step mutates the live tensors
    step, loaded = store.load(map_location="cpu")
    assert step == 4
    assert torch.equal(loaded["model"]["weight"], weight)
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert torch.equal(
        loaded["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"]
    )
    assert loaded["tied"][0] is loaded["tied"][1]
    for key in ("transposed", "scalar", "empty", "mask", "half", "rng"):
        assert loaded[key].dtype == state[key].dtype and torch.equal(loaded[key], state[key])
    assert loaded["meta"] == state["meta"]
    restore_rng_state(loaded["generators"])
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]
    stats = store.last_stats
    assert stats is not None and stats.step == 4 and stats.seconds > 0


def test_a_damaged_current_slot_falls_back_to_the_other(store: SnapshotStore) -> None:
    store.save(1, _state(1))
    store.save(2, _state(2))
    head = json.loads((store.directory / "HEAD").read_text())
    current = store.directory / f"slot-{head['slot']}"
    data = bytearray(current.read_bytes())
    data[HEADER_BYTES + 100] ^= 0xFF  # inside the tensor bytes
    current.write_bytes(bytes(data))
    assert store.load(map_location="cpu")[0] == 1


def test_an_uncommitted_snapshot_is_never_used(store: SnapshotStore) -> None:
    store.save(1, _state(1))
    slot, _ = store._write_slot(2, _state(2))  # complete bytes; the save "died" before HEAD
    assert store.load(map_location="cpu")[0] == 1
    # Even with the committed slot damaged, the newer uncommitted one is refused.
    head = json.loads((store.directory / "HEAD").read_text())
    current = store.directory / f"slot-{head['slot']}"
    data = bytearray(current.read_bytes())
    data[HEADER_BYTES + 8] ^= 0x01
    current.write_bytes(bytes(data))
    assert store.load(map_location="cpu") is None
    store._flip_head(slot, 2)
    step, state = store.load(map_location="cpu")
    assert step == 2 and torch.equal(state["model"]["w"], _state(2)["model"]["w"])


def test_a_snapshot_of_another_config_is_not_used(store: SnapshotStore) -> None:
    store.save(1, _state(1))
    other = SnapshotStore(
        store.directory.name.split("-", 2)[2],
        fingerprint="other",
        root=store.directory.parent,
        is_writer=False,
    )
    assert other.load(map_location="cpu") is None


def test_a_state_that_does_not_fit_is_refused_clearly(shm_root: Path) -> None:
    store = SnapshotStore(
        f"test-{uuid.uuid4().hex[:12]}", fingerprint=FP, root=shm_root, max_bytes=4 << 20
    )
    try:
        store.save(1, _state(1))
        with pytest.raises(SnapshotError, match=r"needs [0-9.]+ MiB .*max_bytes=4194304"):
            store.save(2, _state(2, numel=2_000_000))
        assert store.load(map_location="cpu")[0] == 1
    finally:
        store.remove()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=1777", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_a_full_shm_is_refused_and_keeps_the_previous_snapshot(tiny_tmpfs: Path) -> None:
    store = SnapshotStore("tiny", fingerprint=FP, root=tiny_tmpfs)
    try:
        store.save(1, _state(1, numel=100_000))  # 400 kB
        with pytest.raises(SnapshotError, match="enlarge /dev/shm"):
            store.save(2, _state(2, numel=1_000_000))  # 4 MB
        assert store.load(map_location="cpu")[0] == 1
    finally:
        store.close()  # the mappings would keep the mount busy


def test_a_second_writer_is_refused_until_the_first_is_gone(store: SnapshotStore) -> None:
    run_id = store.directory.name.split("-", 2)[2]
    with pytest.raises(SnapshotError, match="distinct run_ids"):
        SnapshotStore(run_id, fingerprint=FP, root=store.directory.parent)
    store.close()
    SnapshotStore(run_id, fingerprint=FP, root=store.directory.parent).close()


def test_run_id_is_validated(shm_root: Path) -> None:
    with pytest.raises(SnapshotError, match="run_id"):
        SnapshotStore("../etc", fingerprint=FP, root=shm_root)


# ------------------------------------------------------------- torn writes, real kills

_CHILD = textwrap.dedent(
    """
    import os, resource, signal, sys
    import torch
    from elastic_train.state.snapshot import SnapshotStore

    class DieWhenCopied(torch.Tensor):
        # Killed right after the tensor bytes are in the slot, before its header.
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            result = super().__torch_function__(func, types, args, kwargs or {})
            if func in (torch.Tensor.copy_, torch._foreach_copy_):
                os.kill(os.getpid(), signal.SIGKILL)
            return result

    run_id, root, mode = sys.argv[1:4]
    store = SnapshotStore(run_id, fingerprint="fp-snap", root=root)
    def state(step, numel):
        return {"model": {"w": torch.full((numel,), float(step))}, "step": step}
    if mode == "loop":
        step = 0
        while True:  # the parent SIGKILLs us at an arbitrary point
            step += 1
            store.save(step, state(step, 2_000_000))
    store.save(1, state(1, 1000))
    store.save(2, state(2, 1000))
    if mode == "allocating":
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it by default
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        store.save(3, state(3, 4_000_000))  # SIGXFSZ while sizing the slot
    else:
        torn = state(3, 1000)
        torn["model"]["z"] = torch.ones(10).as_subclass(DieWhenCopied)
        store.save(3, torn)  # SIGKILL once "w" and "z" are copied, before the header
    """
)


def _child(run_id: str, root: Path, mode: str) -> ForkedChild:
    return ForkedChild(_CHILD, [run_id, str(root), mode])  # forked: torch is imported


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "signum"), [("allocating", signal.SIGXFSZ), ("copying", signal.SIGKILL)]
)
def test_a_snapshot_killed_halfway_is_never_used(shm_root: Path, mode: str, signum: int) -> None:
    run_id = f"test-{uuid.uuid4().hex[:12]}"
    store = SnapshotStore(run_id, fingerprint=FP, root=shm_root, is_writer=False)
    try:
        assert _child(run_id, shm_root, mode).wait(timeout=120) == -signum
        # step 3 went to slot 0 (1 -> slot 0, 2 -> slot 1) and was erased first
        torn = (store.directory / "slot-0").read_bytes()
        assert not torn.startswith(b"ETSNAP")
        if mode == "copying":  # really torn: step 3's first tensor is in there
            assert torch.full((1000,), 3.0).numpy().tobytes() in torn
        step, state = store.load(map_location="cpu")
        assert step == 2 and torch.equal(state["model"]["w"], torch.full((1000,), 2.0))
    finally:
        store.remove()


def _head_step(head: Path) -> int:
    try:  # the writer creates HEAD, then writes it: it may be empty for a moment
        return int(json.loads(head.read_text())["step"])
    except (FileNotFoundError, ValueError):
        return 0


@pytest.mark.slow
def test_sigkill_at_an_arbitrary_moment_leaves_a_consistent_snapshot(shm_root: Path) -> None:
    run_id = f"test-{uuid.uuid4().hex[:12]}"
    store = SnapshotStore(run_id, fingerprint=FP, root=shm_root, is_writer=False)
    child = _child(run_id, shm_root, "loop")
    try:
        deadline = time.monotonic() + 60
        head = store.directory / "HEAD"
        while _head_step(head) < 3:
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        step, state = store.load(map_location="cpu")
        assert step >= 3 and torch.equal(state["model"]["w"], torch.full((2_000_000,), float(step)))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        store.remove()


# ------------------------------------------------------------------ restore agreement


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([(-1, 10), (12, 10), (12, 10)], RestoreDecision("snapshot", 12, 1)),
        ([(5, 7), (-1, 7), (3, 7)], RestoreDecision("disk", 7, 0)),
        ([(7, 7), (-1, 7)], RestoreDecision("snapshot", 7, 0)),  # a tie goes to memory
        ([(-1, -1), (-1, -1)], RestoreDecision("none", 0, -1)),
        ([(-1, -1), (-1, 4)], RestoreDecision("disk", 4, 1)),
    ],
)
def test_decide_picks_the_newest_and_a_holder(rows: list, expected: RestoreDecision) -> None:
    table = torch.tensor(rows, dtype=torch.int64)
    assert decide(table, list(range(len(rows)))) == expected


def _worker(rank: int, world: int, init: str, root: str, out: str) -> None:
    from elastic_train.state.checkpoint import CheckpointManager
    from elastic_train.state.restore import agree_on_newest, restore_newest

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        # Each rank is a "node" with its own /dev/shm; rank 0 is a new, empty node.
        store = SnapshotStore("agree", fingerprint=FP, root=Path(root) / f"node{rank}")
        if rank > 0:  # "big" ships in two broadcasts (BROADCAST_PIECE_BYTES)
            big = torch.arange(BROADCAST_PIECE_BYTES // 4 + 1024, dtype=torch.float32) + rank
            store.save(10 + rank, {"w": torch.arange(5.0) + 10 + rank, "big": big,
                                   "step": 10 + rank})  # fmt: skip
        snapshot = store.load(map_location="cpu")
        agreement = agree_on_newest(
            local_snapshot_step=snapshot[0] if snapshot else None, disk_step=9, group=None
        )
        mine = snapshot[1] if snapshot and snapshot[0] == agreement.step else None
        shipped = broadcast_state(mine, agreement.owner_rank, None, fingerprint=FP, step=12)
        big = shipped.pop("big")  # not saved below: 16 MiB a rank
        big_shipped = torch.equal(big, torch.arange(big.numel(), dtype=torch.float32) + 2)
        # The one-call restore: first the snapshot wins, then a newer disk checkpoint.
        ckpt = CheckpointManager(
            Path(root) / "ckpt", keep=2, fingerprint=FP, async_save=False, is_writer=rank == 0
        )
        dist.barrier()  # the writer created the directory
        from_snapshot = restore_newest(
            snapshot=store, checkpoint=ckpt, group=None, map_location="cpu"
        )
        del from_snapshot[2]["big"]
        ckpt.save(20, {"w": torch.full((5,), 20.0), "step": 20})
        dist.barrier()  # step 20 is on disk for everyone
        from_disk = restore_newest(snapshot=store, checkpoint=ckpt, group=None, map_location="cpu")
        result = {
            "agreement": list(agreement),
            "state": shipped,
            "big_shipped": big_shipped,
            "from_snapshot": list(from_snapshot),
            "from_disk": list(from_disk),
        }
        torch.save(result, f"{out}/rank{rank}.pt")
        # Together: on torch 2.6 a gloo group's destroy hung now and then (3 in 16
        # runs, as before this test shipped a big state) on ranks whose peer had
        # already exited. With the barrier, 1 hang in 32 runs is left, not explained.
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_group_agrees_and_ships_the_newest_state_over_gloo(tmp_path: Path) -> None:
    world = 3
    for rank in range(world):
        (tmp_path / f"node{rank}").mkdir()
    init = f"file://{tmp_path / 'rendezvous'}"
    start_workers(_worker, args=(world, init, str(tmp_path), str(tmp_path)), nprocs=world)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    for result in results:
        assert result["agreement"] == ["snapshot", 12, 2]
        assert torch.equal(result["state"]["w"], torch.arange(5.0) + 12)
        assert result["big_shipped"]
        assert result["state"]["step"] == 12
        source, step, state = result["from_snapshot"]
        assert (source, step, state["step"]) == ("snapshot", 12, 12)
        assert torch.equal(state["w"], torch.arange(5.0) + 12)
        source, step, state = result["from_disk"]
        assert (source, step) == ("disk", 20) and torch.equal(state["w"], torch.full((5,), 20.0))
