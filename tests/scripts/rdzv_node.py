"""One rendezvous "node" in its own process, as a torchrun agent runs it minus the workers,
so a test can give it a clock of its own (libfaketime) or kill it.

It joins (``next_rendezvous``), then polls ``num_nodes_waiting`` every 0.1 s like
torchrun's monitor loop until ``{out}/stop`` exists. One JSON line per event on
stdout: ``started`` (its wall clock), ``joined`` (rank, world_size), ``round_ended`` (its round was
ended by someone else: it would restart its workers), ``closed``, ``stopped``.

    python rdzv_node.py ENDPOINT RUN_ID MIN MAX SECRET_FILE OUT
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError

from elastic_train.rendezvous import backend


def _relative_sleep(seconds: float) -> None:
    select.select([], [], [], seconds)


if "faketime" in os.environ.get("LD_PRELOAD", ""):
    # libfaketime 0.9.10 with a real monotonic clock (FAKETIME_DONT_FAKE_MONOTONIC=1)
    # fails Python's time.sleep, an absolute clock_nanosleep on CLOCK_MONOTONIC, with
    # EINVAL; a relative wait is unaffected. The wall clock stays skewed.
    time.sleep = _relative_sleep


def _say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main() -> None:
    endpoint, run_id, min_nodes, max_nodes, secret_file, out = sys.argv[1:7]
    params = RendezvousParameters(
        "etcd-v3", endpoint, run_id, int(min_nodes), int(max_nodes),
        secret_file=secret_file, keep_alive_interval=1, keep_alive_max_attempt=3,
        last_call_timeout=1,
    )  # fmt: skip
    _say("started", wall_time=time.time())
    handler = backend.create_handler(params)
    try:
        info = handler.next_rendezvous()
    except RendezvousGracefulExitError:
        _say("closed")
        return
    _say("joined", rank=info.rank, world_size=info.world_size)
    stop = Path(out) / "stop"
    while not stop.exists():
        if handler.num_nodes_waiting() > 0:
            _say("round_ended")
            break
        time.sleep(0.1)
    _say("stopped")
    handler.shutdown()


if __name__ == "__main__":
    main()
