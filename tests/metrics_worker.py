"""A torchrun worker for tests/test_metrics.py: metrics only, no torch import.

Completes 3 steps; the first attempt's local rank 0 then crashes, so the agent
restarts the group. Afterwards each worker reports its environment and waits
for the ``release`` file, so the test scrapes the agent while workers are alive.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from elastic_train.metrics import WorkerMetrics

out = Path(sys.argv[1])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
worker = WorkerMetrics.from_env()
for step in range(1, 4):
    worker.step_completed(step=step, samples=4, seconds=0.01, loss=1.0 / step, world_size=2)
# Step metrics are written at most once a second and at close(); the trainer's
# next steps (or its exit path) would write these, this worker writes them now.
worker.flush()
(out / f"done-{restart}-{worker.local_rank}").touch()
if restart == 0 and worker.local_rank == 0:
    while not (out / "done-0-1").exists():  # crash once both have counted their steps
        time.sleep(0.05)
    sys.exit(1)
report = {"pid": os.getpid(), "dir": os.environ.get("PROMETHEUS_MULTIPROC_DIR")}
# Named by attempt: the first attempt's local rank 1 gets here too before the agent
# stops it, and the test must wait for the second attempt's two.
(out / f"worker-{restart}-{worker.local_rank}.json").write_text(json.dumps(report))
while not (out / "release").exists():
    time.sleep(0.05)
worker.close()
