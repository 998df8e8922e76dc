"""AFTER, as your own script: examples/ddp_migration/before_ddp_tutorial.py with
its loop replaced by one call of ``elastic_train.api.fit`` (docs/training.md,
"Your own script", shows the diff)::

    python examples/own_script/my_train.py                       # one process
    torchrun --standalone --nproc-per-node 2 examples/own_script/my_train.py
    elastic-train local --script examples/own_script/my_train.py --rdzv-conf warm_start=1 \\
        --nodes 3 --chaos kill:1@step20,join:1@step40
    # elastic, fault tolerant, across machines:
    torchrun --nnodes 1:4 --nproc-per-node 2 --rdzv-backend etcd \\
        --rdzv-endpoint ETCD_HOST:2379 --rdzv-id job1 \\
        --rdzv-conf secret_file=/run/secrets/rdzv,warm_start=1 examples/own_script/my_train.py

The script builds the data, the model, the loss and the optimizer as before;
the process group, the sampler, the loop, checkpoints, snapshots and restarts
are the trainer's. Its command line is the trainer's: ``--training.epochs=5``,
``--config job.toml``, ``--help``.
"""

from elastic_train.agent.warm_start import hand_over

hand_over(__file__)  # before torch: warm restarts; the worker dies with its agent

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from elastic_train.api import fit  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    data = TensorDataset(
        torch.randn(2048, 32, generator=gen), torch.randint(0, 8, (2048,), generator=gen)
    )

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    result = fit(
        model=model,
        dataset=data,
        loss=nn.CrossEntropyLoss(reduction="none"),  # one loss per sample
        optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=3e-3),
        config={
            "training": {"epochs": 3, "steps": 0, "global_batch_size": 32},
            "schedule": {"name": "constant", "warmup_steps": 0},
            "checkpoint": {"dir": "checkpoints/own_script"},
        },
    )
    # Only a completed run gets here, and `model` holds the trained weights.
    if result.final_loss is not None:  # rank 0 measures it
        print(f"trained {result.final_step} steps, final loss {result.final_loss:.4f}")


if __name__ == "__main__":
    main()
