"""Where node snapshots live in shared memory, by name only: no torch here.

The local runner removes the snapshots a killed node left behind, and a runner
that only waits for its nodes should not pay torch's import (2 s on a small box)
for that. :mod:`.snapshot` and the training side name their directories here too.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

#: Node-local shared memory: survives a worker, not a reboot.
SHM_ROOT = "/dev/shm"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def node_run_id(run_id: str, node: str) -> str:
    """Unique per run and node: nodes of one machine share ``/dev/shm``."""
    return _UNSAFE.sub("_", f"{run_id}.{node}")[:128]


def snapshot_directory(root: str | Path, run_id: str) -> Path:
    """One user's snapshot directory of ``run_id`` (a :func:`node_run_id`)."""
    return Path(root) / f"elastic_train-{os.getuid()}-{run_id}"


def remove_run_snapshots(run_id: str, *, root: str | Path = SHM_ROOT) -> list[Path]:
    """Remove every node's snapshot of one run on this machine; returns what was removed.

    For a runner that hosts all nodes (``elastic-train local``): a SIGKILLed
    node cannot remove its own, and a later run never reuses the run id.
    """
    prefix = snapshot_directory(root, node_run_id(run_id, "")).name
    removed = [path for path in Path(root).glob("elastic_train-*") if path.name.startswith(prefix)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
