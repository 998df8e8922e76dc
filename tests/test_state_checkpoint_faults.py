"""Storage faults during a checkpoint save: a full disk, and SIGKILL during the replace.

The disk is a real 2 MiB tmpfs mounted for the test (it is skipped where
mounting is not allowed). The kills are real: a child process saves and is
SIGKILLed at the moment it signals, or at random moments. Each time, the
previous checkpoint must still load, byte for byte what it was.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from workers import ForkedChild

from elastic_train.errors import CheckpointWriteError
from elastic_train.state.checkpoint import CheckpointManager

FP = "fp-disk"


def _state(step: int, numel: int, version: int = 0) -> dict:
    return {"w": torch.full((numel,), float(step * 10 + version)), "step": step}


def _digests(directory: Path) -> dict[str, str]:
    """Every file under ``directory``, hashed: what a damaged checkpoint would change."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


@pytest.mark.parametrize("fills_at", ["state", "manifest"])
def test_a_disk_that_fills_during_a_save_keeps_the_previous_checkpoint(
    small_disk: Path, fills_at: str
) -> None:
    manager = CheckpointManager(
        small_disk / "ckpt", keep=3, fingerprint=FP, async_save=True, is_writer=True
    )
    try:
        manager.save(1, _state(1, 50_000), blocking=True)  # 200 kB
        before = _digests(small_disk / "ckpt")
        if fills_at == "state":
            big = _state(2, 1_000_000)  # 4 MB on a 2 MiB disk: fails inside state.pt
        else:
            # Leave room for state.pt to the byte page, and none for the manifest.
            big = _state(2, 50_000)
            vfs = os.statvfs(small_disk)
            free = vfs.f_bavail * vfs.f_frsize
            page = vfs.f_frsize
            state_pages = -(
                -(small_disk / "ckpt" / "step-000000001" / "state.pt").stat().st_size // page
            )
            (small_disk / "filler").write_bytes(bytes(free - state_pages * page))
        manager.save(2, big)  # asynchronous: the failure is counted, not raised
        manager.flush()
        assert manager.consecutive_failures == 1
        assert "No space left on device" in str(manager.last_error)
        with pytest.raises(CheckpointWriteError, match="No space left on device"):
            manager.save(3, big, blocking=True)
        assert _digests(small_disk / "ckpt") == before  # nothing of step 1 changed, no leftovers
        reader = CheckpointManager(
            small_disk / "ckpt", keep=3, fingerprint=FP, async_save=False, is_writer=False
        )
        step, state = reader.load_latest(map_location="cpu")
        assert step == 1 and torch.equal(state["w"], _state(1, 50_000)["w"])
        (small_disk / "filler").unlink(missing_ok=True)
        manager.save(4, _state(4, 50_000), blocking=True)  # the failed saves freed their space
        assert manager.consecutive_failures == 0
    finally:
        manager.close()


# ------------------------------------------------------------ SIGKILL in the replace

_CHILD = textwrap.dedent(
    """
    import os, shutil, sys, time
    from pathlib import Path
    import torch
    from elastic_train.state import checkpoint as ck

    directory, point, marker = sys.argv[1:4]
    manager = ck.CheckpointManager(directory, keep=2, fingerprint="fp-disk",
                                   async_save=False, is_writer=True)
    def state(step, version):
        return {"w": torch.full((200_000,), float(step * 10 + version)), "step": step}

    def reached():  # tell the parent, then wait for its SIGKILL
        Path(marker).write_text(point)
        while True:
            time.sleep(1)

    if point == "random":
        Path(marker).write_text("saving")
        saves = 0
        while True:  # every step twice: a new checkpoint, then its replace
            manager.save(saves // 2 + 1, state(saves // 2 + 1, saves % 2))
            saves += 1
    for step in (1, 2, 3):
        manager.save(step, state(step, 0))
    rename = os.rename
    def patched_rename(src, dst):
        rename(src, dst)
        if point == "moved_aside" and ".tmp-step-replaced" in str(dst):
            reached()  # the older step 3 is aside, the new one not yet in place
        if point == "committed" and Path(dst).name == "step-000000003":
            reached()  # the new step 3 is in place, the older one not yet deleted
    def patched_delete(path):
        (path / ck.MANIFEST).unlink()
        reached()  # a prune half done: the manifest is gone, state.pt is not
    os.rename = patched_rename
    ck.delete_checkpoint = patched_delete  # as the manager's module calls it
    if point == "pruning":
        manager.save(4, state(4, 1))
    else:
        manager.save(3, state(3, 1))  # the replace of an existing step
    """
)


def _kill_when(child: ForkedChild, marker: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (marker.exists() and marker.read_text() == text):
        assert child.poll() is None, f"the saving child exited with {child.returncode}"
        assert time.monotonic() < deadline, f"the child never reached {text!r}"
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL


def _load(directory: Path, *, writer: bool) -> CheckpointManager:
    return CheckpointManager(directory, keep=2, fingerprint=FP, async_save=False, is_writer=writer)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "latest", "older"),
    [
        ("moved_aside", (3, 30.0), (2, 20.0)),  # the next writer puts the older step 3 back
        ("committed", (3, 31.0), (2, 20.0)),
        ("pruning", (4, 41.0), (3, 30.0)),
    ],
)
def test_sigkill_during_the_replace_leaves_loadable_checkpoints(
    tmp_path: Path, point: str, latest: tuple[int, float], older: tuple[int, float]
) -> None:
    directory, marker = tmp_path / "ckpt", tmp_path / "marker"
    child = ForkedChild(_CHILD, [str(directory), point, str(marker)])
    try:
        _kill_when(child, marker, point)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    # Before the restarted writer cleans up, a reader already finds a good checkpoint.
    step, state = _load(directory, writer=False).load_latest(map_location="cpu")
    assert step in (latest[0], older[0]) and state["w"][0].item() in (latest[1], older[1])
    manager = _load(directory, writer=True)  # the restart: removes or restores leftovers
    assert not list(directory.glob(".tmp-*"))
    for step, value in (latest, older):
        state = manager.load(step, map_location="cpu")
        assert torch.equal(state["w"], torch.full((200_000,), value)), (point, step)
    assert manager.latest_step() == latest[0]


@pytest.mark.slow
def test_sigkill_at_random_moments_of_saves_and_replaces(tmp_path: Path) -> None:
    directory, marker = tmp_path / "ckpt", tmp_path / "marker"
    rng = random.Random(18)
    loaded = []
    for _ in range(5):  # forked from the forkserver: a child starts in milliseconds
        child = ForkedChild(_CHILD, [str(directory), "random", str(marker)])
        try:
            deadline = time.monotonic() + 60
            while not marker.exists() or not any(directory.glob("step-*")):
                assert child.poll() is None and time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))  # a random moment of the save loop
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        marker.unlink()
        manager = _load(directory, writer=True)
        complete = [p for p in directory.glob("step-*") if (p / "MANIFEST.json").exists()]
        assert complete, "every kill leaves a complete checkpoint"
        for path in complete:  # each complete one loads and holds what was saved as it
            step = int(path.name.removeprefix("step-"))
            value = manager.load(step, map_location="cpu")["w"]
            assert value[0].item() // 10 == step and torch.equal(value, value[0].expand(200_000))
        loaded.append(manager.latest_step())
    assert all(step is not None for step in loaded)
