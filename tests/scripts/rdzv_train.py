"""A tiny DDP training over gloo that runs until the test releases it.

Every rank appends one JSON line per step to ``{out}/steps-{pid}.jsonl`` (``step``,
``rank``, ``world_size``, ``time``); rank 0 keeps ``{out}/ckpt.pt`` so a restarted
group resumes. Once ``{out}/release`` exists, all ranks stop after the same step
(agreed by an all-reduce) and exit 0, so a test decides when the job ends instead
of racing a fixed number of steps against a loaded machine.

    torchrun ... rdzv_train.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    checkpoint = out / "ckpt.pt"
    step = int(torch.load(checkpoint, weights_only=True)["step"]) if checkpoint.exists() else 0
    with open(out / f"steps-{os.getpid()}.jsonl", "a") as log:
        while True:
            loss = model(torch.randn(8, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0:
                torch.save({"step": step}, checkpoint.with_suffix(".tmp"))
                os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
            record = {"step": step, "rank": rank, "world_size": world_size, "time": time.time()}
            log.write(json.dumps(record) + "\n")
            log.flush()
            released = torch.tensor([float((out / "release").exists())])
            dist.all_reduce(released, op=dist.ReduceOp.MAX)
            if released.item():
                break
            time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
