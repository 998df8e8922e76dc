"""One restore decision over a real gloo group, whatever each rank sees on disk.

Three worker processes, each with its own view of the checkpoint directory,
as ranks on different hosts have of a network file system: one view lags
(lacks the newest step), one has the newest step's data damaged (its read
fails verification), in one case no rank can read the newest step. Every
rank must restore one and the same step: the newest that some rank can load,
shipped to the others by broadcast, or the next older one when none can.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from workers import start_workers

from elastic_train.errors import CheckpointMismatchError
from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.state.restore import RestoreDecision, decide, restore_newest
from elastic_train.state.snapshot import SnapshotStore

FP = "fp-agree"
WORLD = 3
#: scenario -> the checkpoint directory view of each rank (a subdirectory of the test's)
VIEWS = {
    "lagging": ("shared", "shared", "lagging"),
    "damaged": ("shared", "damaged", "shared"),
    "unreadable": ("damaged", "damaged", "damaged"),
    "snapshot": ("shared", "shared", "lagging"),
}


def _state(step: int) -> dict:
    return {"w": torch.full((2000,), float(step)), "step": step}


def _flip_state(step_dir: Path) -> None:
    path = step_dir / "state.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _prepare(root: Path) -> None:
    shared = CheckpointManager(
        root / "shared", keep=3, fingerprint=FP, async_save=False, is_writer=True
    )
    for step in (10, 20):
        shared.save(step, _state(step))
    shared.close()
    shutil.copytree(root / "shared", root / "lagging")
    shutil.rmtree(root / "lagging" / "step-000000020")  # not listed there yet
    shutil.copytree(root / "shared", root / "damaged")
    _flip_state(root / "damaged" / "step-000000020")  # listed, fails its crc32
    # Node 0 holds snapshots of steps 24 and 25, and 25's header has a flipped bit.
    store = SnapshotStore("agree", fingerprint=FP, root=root / "node0")
    store.save(24, _state(24))
    store.save(25, _state(25))
    head = json.loads((store.directory / "HEAD").read_text())
    slot = store.directory / f"slot-{head['slot']}"
    data = bytearray(slot.read_bytes())
    data[data.index(b'"step": ') + len(b'"step": ')] ^= 0x01
    slot.write_bytes(bytes(data))
    store.close()


def _worker(rank: int, init: str, root: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    base = Path(root)
    results = {}
    try:
        for scenario, views in VIEWS.items():
            checkpoint = CheckpointManager(
                base / views[rank], keep=3, fingerprint=FP, async_save=False, is_writer=False
            )
            snapshot = None
            if scenario == "snapshot":
                snapshot = SnapshotStore(
                    "agree", fingerprint=FP, root=base / f"node{rank}", is_writer=False
                )
            restored = restore_newest(
                snapshot=snapshot, checkpoint=checkpoint, group=None, map_location="cpu"
            )
            results[scenario] = (restored.source, restored.step, restored.state)
        # A checkpoint of another config is an error on every rank, not only the one that reads it.
        foreign = CheckpointManager(
            base / "shared", keep=3, fingerprint="other" if rank == 1 else FP,
            async_save=False, is_writer=False,
        )  # fmt: skip
        try:
            restore_newest(snapshot=None, checkpoint=foreign, group=None, map_location="cpu")
            results["mismatch"] = "restored"
        except CheckpointMismatchError as exc:
            results["mismatch"] = str(exc)
        torch.save(results, base / f"rank{rank}.pt")
        # Every rank done before any tears its group down: torch 2.6's gloo can
        # hang in destroy_process_group once a peer has exited.
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_restores_the_same_step_whatever_its_view(tmp_path: Path) -> None:
    for rank in range(WORLD):  # each rank a node with its own /dev/shm
        (tmp_path / f"node{rank}").mkdir()
    _prepare(tmp_path)
    init = f"file://{tmp_path / 'rendezvous'}"
    start_workers(_worker, args=(init, str(tmp_path)), nprocs=WORLD)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    expected = {
        "lagging": ("disk", 20),  # rank 2 did not list it: it receives it
        "damaged": ("disk", 20),  # rank 1 failed to read it: it receives it
        "unreadable": ("disk", 10),  # nobody could: all fall back together
        "snapshot": ("snapshot", 24),  # 25's header is damaged: the older slot
    }
    for rank, result in enumerate(results):
        for scenario, (source, step) in expected.items():
            got_source, got_step, state = result[scenario]
            assert (got_source, got_step, state["step"]) == (source, step, step), (rank, scenario)
            assert torch.equal(state["w"], torch.full((2000,), float(step))), (rank, scenario)
        assert "rank 1 found checkpoint step 20" in result["mismatch"], rank


@pytest.mark.parametrize(
    ("rows", "refused", "expected"),
    [
        # columns: snapshot step, then the disk steps each rank can read (-1: none)
        ([(-1, 20, 10), (-1, 10, -1), (-1, 20, 10)], set(), RestoreDecision("disk", 20, 0)),
        ([(-1, 20, 10), (-1, 10, -1)], {("disk", 20)}, RestoreDecision("disk", 10, 0)),
        ([(-1, 10, -1), (-1, 20, 10)], set(), RestoreDecision("disk", 20, 1)),  # rank 0 lags
        ([(25, 20, 10), (-1, 20, 10)], {("snapshot", 25)}, RestoreDecision("disk", 20, 0)),
        ([(20, 20, -1), (-1, 20, -1)], set(), RestoreDecision("snapshot", 20, 0)),
        ([(-1, 20, -1)], {("disk", 20)}, RestoreDecision("none", 0, -1)),
    ],
)
def test_decide_skips_what_no_holder_could_load(
    rows: list, refused: set, expected: RestoreDecision
) -> None:
    table = torch.tensor(rows, dtype=torch.int64)
    assert decide(table, list(range(len(rows))), refused=frozenset(refused)) == expected
