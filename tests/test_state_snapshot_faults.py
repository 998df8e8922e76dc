"""Damaged and foreign snapshots: refused with a warning, and the restore falls through.

A header bit flip, a symlinked or foreign-owned directory, a symlinked file:
each is refused by every reader (not only the writer), and ``restore_newest``
resumes from the next source (the other slot, the disk) instead of raising,
which under torchrun would restart the worker into the same error forever.
The end-to-end test restarts real trainer processes over a flipped header.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs
from trainer_procs import TINY_JOB, final_params, run_workers

from elastic_train.audit import AuditLog
from elastic_train.errors import SnapshotRefusedError
from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.state.restore import restore_newest
from elastic_train.state.snapshot import SnapshotStore
from elastic_train.state.snapshot_layout import HEADER_BYTES, MAGIC

FP = "fp-faults"
SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None


@pytest.fixture
def shm_root(tmp_path: Path) -> Path:
    return SHM or tmp_path


@pytest.fixture
def run_id(shm_root: Path) -> Iterator[str]:
    run = f"test-{uuid.uuid4().hex[:12]}"
    yield run
    for path in shm_root.glob(f"elastic_train-{os.getuid()}-{run}*"):
        if path.is_symlink():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((1000,), float(step))}, "step": step}


def _current_slot(store: SnapshotStore) -> Path:
    head = json.loads((store.directory / "HEAD").read_text())
    return store.directory / f"slot-{head['slot']}"


def _flip(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def _header_offsets(path: Path) -> dict[str, int]:
    """Where in a slot's header the step digit, a size, the fingerprint, padding and crc are."""
    header = path.read_bytes()[:HEADER_BYTES]
    return {
        "magic": 3,
        "step": header.index(b'"step": ') + len(b'"step": '),
        "size": header.index(b'"data_bytes": ') + len(b'"data_bytes": '),
        "fingerprint": header.index(FP.encode()) + 3,
        "padding": HEADER_BYTES - 100,
        "crc": HEADER_BYTES - 2,
    }


@pytest.mark.parametrize("where", ["magic", "step", "size", "fingerprint", "padding", "crc"])
def test_a_header_bit_flip_falls_back_to_the_other_slot(
    shm_root: Path, run_id: str, where: str
) -> None:
    store = SnapshotStore(run_id, fingerprint=FP, root=shm_root)
    try:
        store.save(1, _state(1))
        store.save(2, _state(2))
        current = _current_slot(store)
        # Bit 0 of the step's digit turns "2" into "3": without a header
        # checksum, a plausible, wrong step that nothing else would catch.
        _flip(current, _header_offsets(current)[where])
        reader = SnapshotStore(run_id, fingerprint=FP, root=shm_root, is_writer=False)
        with capture_logs() as logs:
            assert reader.latest_step() == 1
            step, state = reader.load(map_location="cpu")
        assert step == 1 and torch.equal(state["model"]["w"], _state(1)["model"]["w"])
        refused = [e for e in logs if e["event"] == "snapshot_refused"]
        assert refused and all(e["log_level"] == "warning" for e in refused)
        assert current.name in refused[0]["reason"]
    finally:
        store.remove()


def test_both_slots_damaged_restores_from_disk_without_raising(
    shm_root: Path, run_id: str, tmp_path: Path
) -> None:
    store = SnapshotStore(run_id, fingerprint=FP, root=shm_root)
    checkpoint = CheckpointManager(
        tmp_path / "ckpt", keep=2, fingerprint=FP, async_save=False, is_writer=True
    )
    try:
        checkpoint.save(3, _state(3))
        store.save(4, _state(4))
        store.save(5, _state(5))
        for slot in (0, 1):  # a flipped step digit in each header
            path = store.directory / f"slot-{slot}"
            _flip(path, _header_offsets(path)["step"])
        restored = restore_newest(
            snapshot=store, checkpoint=checkpoint, group=None, map_location="cpu"
        )
        assert (restored.source, restored.step) == ("disk", 3)
        assert torch.equal(restored.state["model"]["w"], _state(3)["model"]["w"])
    finally:
        store.remove()
        checkpoint.close()


def test_a_slot_of_another_run_falls_through_to_disk(
    shm_root: Path, run_id: str, tmp_path: Path
) -> None:
    """A slot that verifies but belongs to another config (fingerprint) is never decoded."""
    store = SnapshotStore(run_id, fingerprint="someone-else", root=shm_root)
    checkpoint = CheckpointManager(
        tmp_path / "ckpt", keep=2, fingerprint=FP, async_save=False, is_writer=True
    )
    try:
        store.save(9, _state(9))
        checkpoint.save(3, _state(3))
        ours = SnapshotStore(run_id, fingerprint=FP, root=shm_root, is_writer=False)
        restored = restore_newest(
            snapshot=ours, checkpoint=checkpoint, group=None, map_location="cpu"
        )
        assert (restored.source, restored.step) == ("disk", 3)
    finally:
        store.remove()
        checkpoint.close()


def _planted(shm_root: Path, tmp_path: Path, step: int) -> Path:
    """A complete, valid snapshot directory of step ``step`` outside the shm root."""
    elsewhere = tmp_path / "planted"
    elsewhere.mkdir()
    other = SnapshotStore("planted", fingerprint=FP, root=elsewhere)
    other.save(step, _state(step))
    other.close()
    return other.directory


def _assert_refused(run_id: str, shm_root: Path, reason: str) -> None:
    reader = SnapshotStore(run_id, fingerprint=FP, root=shm_root, is_writer=False)
    assert reader.latest_step() is None and reader.load(map_location="cpu") is None
    with pytest.raises(SnapshotRefusedError, match=reason):
        SnapshotStore(run_id, fingerprint=FP, root=shm_root)  # the writer


def test_a_symlinked_snapshot_directory_is_refused(
    shm_root: Path, run_id: str, tmp_path: Path
) -> None:
    target = _planted(shm_root, tmp_path, 7)  # valid, our uid, 0700: only the link is wrong
    (shm_root / f"elastic_train-{os.getuid()}-{run_id}").symlink_to(target)
    _assert_refused(run_id, shm_root, "symlink")
    assert SnapshotStore("planted", fingerprint=FP, root=target.parent).latest_step() == 7


def test_a_snapshot_directory_open_to_others_is_refused(
    shm_root: Path, run_id: str, tmp_path: Path
) -> None:
    store = SnapshotStore(run_id, fingerprint=FP, root=shm_root)
    store.save(1, _state(1))
    store.close()
    store.directory.chmod(0o755)
    _assert_refused(run_id, shm_root, "mode 0755")


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_a_foreign_owned_snapshot_directory_is_refused(shm_root: Path, run_id: str) -> None:
    store = SnapshotStore(run_id, fingerprint=FP, root=shm_root)
    store.save(1, _state(1))
    store.close()
    os.chown(store.directory, 65534, 65534)
    _assert_refused(run_id, shm_root, "owned by uid 65534")


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_a_foreign_owned_slot_is_refused(shm_root: Path, run_id: str) -> None:
    store = SnapshotStore(run_id, fingerprint=FP, root=shm_root)
    store.save(1, _state(1))
    store.save(2, _state(2))
    os.chown(_current_slot(store), 65534, 65534)
    reader = SnapshotStore(run_id, fingerprint=FP, root=shm_root, is_writer=False)
    assert reader.load(map_location="cpu")[0] == 1  # the other slot, ours, is used
    store.remove()


def test_a_symlinked_slot_or_head_is_refused(shm_root: Path, run_id: str, tmp_path: Path) -> None:
    target = _planted(shm_root, tmp_path, 7)
    store = SnapshotStore(run_id, fingerprint=FP, root=shm_root)
    store.save(1, _state(1))
    store.close()
    (store.directory / "slot-0").unlink()
    (store.directory / "slot-0").symlink_to(target / "slot-0")  # a valid slot of step 7
    reader = SnapshotStore(run_id, fingerprint=FP, root=shm_root, is_writer=False)
    assert reader.load(map_location="cpu") is None
    (store.directory / "HEAD").unlink()
    (store.directory / "HEAD").symlink_to(target / "HEAD")
    assert (
        SnapshotStore(run_id, fingerprint=FP, root=shm_root, is_writer=False).load(
            map_location="cpu"
        )
        is None
    )


def test_a_snapshot_of_an_older_format_is_refused_by_magic(shm_root: Path, run_id: str) -> None:
    store = SnapshotStore(run_id, fingerprint=FP, root=shm_root)
    try:
        store.save(1, _state(1))
        path = _current_slot(store)
        data = bytearray(path.read_bytes())
        data[: len(MAGIC)] = b"ETSNAP5\n"  # the format before the header checksum
        path.write_bytes(bytes(data))
        assert (
            SnapshotStore(run_id, fingerprint=FP, root=shm_root, is_writer=False).load(
                map_location="cpu"
            )
            is None
        )
    finally:
        store.remove()


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.skipif(SHM is None, reason="the trainer snapshots to /dev/shm")
def test_training_resumes_from_the_older_slot_after_a_header_bit_flip(
    tmp_path: Path, run_id: str
) -> None:
    """Real trainer processes (2 gloo workers): a step fails on every rank; the
    snapshot of the step before gets a flipped bit in its header; the restart
    resumes from the one before that (the other slot), and ends exactly as a
    run without faults."""
    fail = tmp_path / "fail"
    model = ["model.name=trainer_procs:failing_mlp", "model.options.fail_at_forward=16",
             f"model.options.fail_file={fail}"]  # fmt: skip
    job = [*TINY_JOB, *model, "training.steps=10", "elastic.snapshot_every_steps=1",
           "checkpoint.interval_steps=100"]  # fmt: skip
    run_workers(2, [*job, "checkpoint.dir=", f"logging.audit_dir={tmp_path / 'reference'}"])
    job.append(f"checkpoint.dir={tmp_path / 'ckpt'}")
    fail.touch()
    audit = tmp_path / "audit"
    with pytest.raises(Exception, match="injected failure"):
        run_workers(2, [*job, f"logging.audit_dir={audit}"], run_id=run_id)
    store = SnapshotStore(f"{run_id}.node0", fingerprint="", root="/dev/shm", is_writer=False)
    current = _current_slot(store)
    failed_after = json.loads((store.directory / "HEAD").read_text())["step"]
    assert 2 <= failed_after < 10  # the last step completed before the failure
    _flip(current, current.read_bytes().index(b'"step": ') + len(b'"step": '))
    fail.unlink()
    log = tmp_path / "restart.log"
    run_workers(2, [*job, f"logging.audit_dir={audit}"], run_id=run_id, stderr=log)
    restart = AuditLog.load(audit).attempts()[-1]
    assert (restart.restored_step, restart.restore_source) == (failed_after - 1, "snapshot")
    assert min(restart.steps) == failed_after and max(restart.steps) == 10
    # Both ranks recorded every step under one attempt id (a tensor broadcast, not a pickle).
    assert all(len(records) == 2 for records in restart.steps.values())
    assert len(restart.id) == 12 and int(restart.id, 16) >= 0
    refused = [line for line in log.read_text().splitlines() if "snapshot_refused" in line]
    assert refused and current.name in refused[0]
    expected = final_params(tmp_path / "reference")
    for name, value in final_params(audit).items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0)
