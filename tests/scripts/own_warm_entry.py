"""A user's own torchrun entry that asks for the warm start (tests/test_warm_start.py).

Usage: own_warm_entry.py OUT_DIR EXIT_CODE. Writes what it saw to OUT_DIR.
"""

import sys

from elastic_train.agent.warm_start import hand_over

hand_over(__file__)  # returns only to start cold
# torch is there before this script imports it only in a child of the zygote.
PRELOADED = "torch" in sys.modules

import json  # noqa: E402
import os  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402

if __name__ == "__main__":
    out, code = sys.argv[1], int(sys.argv[2])
    report = {
        "preloaded": PRELOADED,
        "parent": psutil.Process(os.getppid()).name(),
        # torch refuses CUDA in a fork of a process that asked the driver anything: on a
        # GPU this worker could not train. False on a CPU-only torch build.
        "cuda_bad_fork": torch.cuda._is_in_bad_fork(),
    }
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as fh:
        json.dump(report, fh)
    sys.exit(code)
