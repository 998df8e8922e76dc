"""A plain FSDP2 training script of the usual tutorial shape: the competitor of
``training.parallel = "fsdp2"`` in ``benchmarks/throughput_fsdp2.py``.

What the FSDP2 tutorial does and nothing more: ``fully_shard`` on each layer
that holds parameters, then on the root; every rank ``dcp.save``s the sharded
state every ``--checkpoint.interval_steps`` steps and resumes from it at start.
The model, the data, the sample order, the optimizer recipe, the flags and
the audit records are those of ``plain_ddp.py`` (imported from it), so the two
plain scripts differ only in the parallelism and the checkpoint.
"""

from __future__ import annotations

import datetime
import uuid

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from elastic_train.config.job import OptimizerConfig
from elastic_train.training.optim import build_optimizer

try:
    from benchmarks.competitors.plain_ddp import Audit, build, optimizer_step, parse_args, shard
except ImportError:  # run as a script: torchrun puts this directory first on sys.path
    from plain_ddp import Audit, build, optimizer_step, parse_args, shard  # type: ignore[no-redef]


def checkpoint_state(model: nn.Module, opt: torch.optim.Optimizer, pos: torch.Tensor) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd, "position": pos}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, inputs, targets = build(args)
    for layer in model:
        if next(layer.parameters(), None) is not None:
            fully_shard(layer)
    fully_shard(model)
    opt = build_optimizer(OptimizerConfig(lr=args.lr), model)
    ckpt = args.ckpt_dir / "dcp"
    pos = torch.zeros(3, dtype=torch.int64)  # step, epoch, position
    if (ckpt / ".metadata").exists():
        state = checkpoint_state(model, opt, pos)
        dcp.load(state, checkpoint_id=str(ckpt))
        set_state_dict(
            model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
    step, epoch, position = (int(v) for v in pos.tolist())

    attempt = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(attempt, src=0)
    audit = Audit(args.audit_dir, attempt=str(attempt[0]), rank=rank, world=world)
    source = "disk" if step else "none"
    audit.write(kind="resume", restored_step=step, source=source, dataset_len=len(inputs))

    perm = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(args.seed + epoch))
    while step < args.steps:
        if position >= len(inputs):
            epoch, position = epoch + 1, 0
            gen = torch.Generator().manual_seed(args.seed + epoch)
            perm = torch.randperm(len(inputs), generator=gen)
        batch = perm[position : position + args.global_batch_size]
        mine = shard(batch, rank, world)
        loss = nn.functional.cross_entropy(model(inputs[mine]), targets[mine])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        optimizer_step(model, opt, args, step=step)
        step, position = step + 1, position + len(batch)
        audit.write(
            kind="step", step=step, epoch=epoch, indices=mine.tolist(), loss=float(loss.item())
        )
        if step % args.ckpt_every == 0:
            pos = torch.tensor([step, epoch, position], dtype=torch.int64)
            dcp.save(checkpoint_state(model, opt, pos), checkpoint_id=str(ckpt))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
