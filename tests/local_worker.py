"""A trivial torchrun worker for the runner's process-supervision tests.

``python tests/local_worker.py RUN_DIR [SECONDS]``: writes
``RUN_DIR/alive/<node>-<pid>`` and idles until ``RUN_DIR/finish`` exists (or
SECONDS passed), then exits 0. No torch import, so a
node is up in the time torchrun's agent needs, and nothing but the runner's
signals can end it early.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main(run_dir: str, seconds: float) -> int:
    alive = Path(run_dir) / "alive"
    alive.mkdir(parents=True, exist_ok=True)
    (alive / f"{os.environ['ELASTIC_TRAIN_NODE']}-{os.getpid()}").write_text(
        os.environ.get("WORLD_SIZE", "1")
    )
    deadline = time.monotonic() + seconds
    while not (Path(run_dir) / "finish").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else float("inf")))
