"""BEFORE: a classic DistributedDataParallel script, the shape of the usual tutorial.

    python -m torch.distributed.launch --nproc_per_node 2 before_ddp_tutorial.py --epochs 3

Kept here only to show the migration (docs/migrating.md); it runs, but a lost
worker ends the job and a restart starts from the last epoch's torch.save.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    data = TensorDataset(
        torch.randn(2048, 32, generator=gen), torch.randint(0, 8, (2048,), generator=gen)
    )
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}")
            torch.save(model.module.state_dict(), f"checkpoint_{epoch}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
