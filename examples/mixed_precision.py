"""Mixed precision and gradient compression (NVIDIA Apex's amp, Horovod's Compression).

``training.precision``: ``bf16`` runs the forward and backward matmuls in
bfloat16 (CPU and CUDA, no loss scaling); ``fp16`` adds a ``GradScaler`` whose
scale is saved in every checkpoint. ``training.comm_hook`` compresses the DDP
gradient all-reduce: ``fp16``/``bf16`` halve the bytes, ``powersgd`` sends a
low-rank approximation (needs numpy)::

    # CPU, two processes:
    torchrun --standalone --nproc-per-node 2 examples/mixed_precision.py
    # a GPU node: fp16 autocast with loss scaling, fp16 gradients on the wire
    torchrun --standalone --nproc-per-node 8 examples/mixed_precision.py \\
        --training.precision=fp16 --training.comm_hook=fp16
"""

from __future__ import annotations

import sys

from elastic_train.main import main

if __name__ == "__main__":
    sys.exit(
        main(
            [
                "--model.name=mlp",
                "--data.name=digits",
                "--training.steps=60",
                "--training.precision=bf16",
                "--training.comm_hook=bf16",
                "--checkpoint.dir=",
                *sys.argv[1:],
            ]
        )
    )
