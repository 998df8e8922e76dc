"""Distributed evaluation during and after training.

Every ``eval.every_steps`` steps, and once more at the end with
``eval.at_end``, each rank evaluates a contiguous run of whole micro-batches of
the evaluation set; loss, correct predictions and sample counts are reduced as
sums, so the logged ``evaluation`` event is the single-process result, bit for
bit, at any world size (``elastic_train/training/evaluate.py`` explains why)::

    torchrun --standalone --nproc-per-node 3 examples/evaluation.py

The same function works outside the trainer, on any model and map-style
dataset; the second half of this script shows that.
"""

from __future__ import annotations

import sys

from elastic_train.config.load import load_config
from elastic_train.main import main
from elastic_train.training.evaluate import evaluate
from elastic_train.workload.datasets import digits
from elastic_train.workload.models import cross_entropy, mlp

if __name__ == "__main__":
    code = main([
        "--model.name=mlp", "--data.name=digits", "--training.steps=60",
        "--eval.every_steps=20", "--eval.at_end=true", "--eval.batch_size=128",
        "--checkpoint.dir=", *sys.argv[1:],
    ])  # fmt: skip
    if code:
        sys.exit(code)

    # Stand-alone use (one process here; pass rank/world_size inside a process group).
    cfg = load_config(None, ["model.name=mlp", "data.name=digits"])
    data = digits(cfg.data)
    model = mlp(cfg.model, data.info)
    result = evaluate(model, data.dataset, loss_fn=cross_entropy, batch_size=128)
    print(f"untrained model: loss {result.loss:.4f}, accuracy {result.accuracy:.3f} "
          f"over {result.samples} samples")  # fmt: skip
