"""A tiny DDP training over gloo for the rendezvous end-to-end tests.

Every rank appends one JSON line per completed step to ``{out}/steps-{pid}.jsonl``
(``step``, ``rank``, ``world_size``); rank 0 keeps ``{out}/ckpt.pt`` so a restarted
worker group (a node joined or left) resumes from the last step.
``--hold-until-world-size N`` parks the group before its last step until N nodes
train together, so a test can wait for a joiner without racing the training.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hold-until-world-size", type=int, default=1)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    checkpoint = args.out / "ckpt.pt"
    step = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        model.module.load_state_dict(state["model"])
        step = int(state["step"])

    with open(args.out / f"steps-{os.getpid()}.jsonl", "a") as log:
        while step < args.steps:
            if step + 1 == args.steps and world_size < args.hold_until_world_size:
                time.sleep(args.step_seconds)  # the agent restarts us once a node joins
                continue
            loss = model(torch.randn(8, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0:
                tmp = checkpoint.with_suffix(".tmp")
                torch.save({"model": model.module.state_dict(), "step": step}, tmp)
                os.replace(tmp, checkpoint)
            record = {"step": step, "rank": rank, "world_size": world_size, "time": time.time()}
            log.write(json.dumps(record) + "\n")
            log.flush()
            time.sleep(args.step_seconds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
