"""Join stall when the next process group is formed in the background (#20 item 2).

Today an admission rebuilds torch's default process group: the members
destroy it, form a new one with the joiner, and wrap DDP again, and they
stall for all of it (benchmarks/README.md, item 2: 0.09-0.14 s). This
measures the design torchft uses instead, before anyone builds it into the
trainer: DDP on a process group of our own, a gloo group that is *not*
torch's default group, the next group formed by a background thread while
the members keep stepping on the current one, and the switch at a step
boundary.

Three processes on one TCPStore, the benchmark MLP, AdamW. Two members train
``--steps-before`` steps on a group of two, then admit the third process, and
all three train ``--steps-after`` steps. Two variants, interleaved:

- ``reinit`` (the anchor: today's mechanism): at the join step the members
  destroy the default group, the three form a new default group
  (``init_process_group`` on a fresh store prefix), rank 0 broadcasts the
  state, and DDP wraps again.
- ``background``: the members train on a standalone group; at the join step
  every process starts forming the next standalone group in a thread, the
  members keep stepping and learn that it is ready from an all-reduce of a
  flag after each step (a real trainer would carry the flag in its check
  step's all-reduce), then broadcast the state on it and wrap DDP again.

Per member: the median step at 2, the stall (last step at 2 to first step at
3, less the median step at 3), its parts (state broadcast, DDP wrap) and the
background formation. Correctness: every rank ends with the same parameters.

    python -m benchmarks.group_swap --repeats 5
"""

from __future__ import annotations

import datetime
import itertools
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks import harness

TIMEOUT = datetime.timedelta(seconds=60)
METRICS = (
    "stall_ms", "stall_steps", "before_switch_ms", "switch_ms", "broadcast_ms", "wrap_ms",
    "first_step_extra_ms", "formation_ms", "step_ms", "step3_ms",
)  # fmt: skip
#: #20 item 2: the survivors stall at most one step.
TARGET_STALL_STEPS = 1.0
_BATCH = 48  # divisible by 2 and 3: every rank's share is whole at both sizes


@dataclass(frozen=True)
class Variant:
    name: str

    def unavailable(self) -> str | None:
        return None


VARIANTS = (Variant("reinit"), Variant("background"))


def standalone_gloo(store: dist.Store, prefix: str, rank: int, size: int) -> dist.ProcessGroup:
    """A gloo process group that torch's registry does not know: not the default
    group, destroyed when the last reference goes. Private torch API (the steps
    of ``_new_process_group_helper``), checked on torch 2.13."""
    group_store = dist.PrefixStore(f"{prefix}/", store)
    group = dist.ProcessGroup(group_store, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", group_store), rank, size, TIMEOUT)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_group_name(prefix)
    return group


class Run:
    """One process's model, optimizer, batch and step records."""

    def __init__(self, rank: int, *, pace_s: float) -> None:
        torch.manual_seed(0)
        self.rank, self.pace_s = rank, pace_s
        self.model = nn.Sequential(
            nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(_BATCH, 32, generator=gen)
        self.y = torch.randint(0, 8, (_BATCH,), generator=gen)
        self.step = 0
        self.times: list[tuple[int, float]] = []  # (world size, end of step)
        self.retired: list[dist.ProcessGroup] = []  # groups left behind by a switch

    def train_step(self, ddp: nn.Module, world: int) -> None:
        inputs, target = self.x[self.rank :: world], self.y[self.rank :: world]
        if self.pace_s:
            time.sleep(self.pace_s)  # a step of a real model's length, as the soak paces
        loss = nn.functional.cross_entropy(ddp(inputs), target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.step += 1
        self.times.append((world, time.perf_counter()))

    def _state_tensors(self) -> list[torch.Tensor]:
        """Parameters and AdamW's moments and step counters (the joiner's must exist first)."""
        params = [p.data for p in self.model.parameters()]
        state = [self.opt.state[p] for p in self.model.parameters()]
        moments = [s[k] for s in state for k in ("exp_avg", "exp_avg_sq", "step")]
        return params + moments

    def flat_state(self) -> torch.Tensor:
        """The step counter and :meth:`_state_tensors` in one tensor: one broadcast."""
        counter = torch.tensor([float(self.step)])
        return torch.cat([counter, *(t.reshape(-1) for t in self._state_tensors())])

    def load_flat(self, flat: torch.Tensor) -> None:
        self.step = int(flat[0].item())
        offset = 1
        for tensor in self._state_tensors():
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()

    def prime_optimizer(self) -> None:
        """The joiner's AdamW state tensors, so a broadcast can fill them."""
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


def _broadcast(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> None:
    if group is None:
        dist.broadcast(tensor, src=0)
        return
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _switch(run: Run, group: dist.ProcessGroup | None) -> tuple[nn.Module, dict[str, float]]:
    """Rank 0's state to everyone on ``group`` (None: the default group), then DDP on it."""
    started = time.perf_counter()
    if run.rank == 2:
        run.prime_optimizer()
    flat = run.flat_state()
    _broadcast(group, flat)
    if run.rank == 2:
        run.load_flat(flat)
    broadcast = time.perf_counter()
    ddp = DistributedDataParallel(run.model, process_group=group)
    done = time.perf_counter()
    parts = {"broadcast_ms": 1e3 * (broadcast - started), "wrap_ms": 1e3 * (done - broadcast)}
    return ddp, {**parts, "switch_started": started, "switch_done": done}


def _default_group(store: dist.Store, prefix: str, rank: int, size: int) -> None:
    """torch's default group on ``store`` under ``prefix``: today's re-init."""
    group_store = dist.PrefixStore(prefix, store)
    dist.init_process_group("gloo", store=group_store, rank=rank, world_size=size, timeout=TIMEOUT)


def _members_reinit(run: Run, store: dist.Store, before: int) -> tuple[nn.Module, dict[str, float]]:
    _default_group(store, "g1", run.rank, 2)
    ddp = DistributedDataParallel(run.model)
    while run.step < before:
        run.train_step(ddp, 2)
    del ddp
    dist.destroy_process_group()
    _default_group(store, "g2", run.rank, 3)
    return _switch(run, None)


def _members_background(
    run: Run, store: dist.Store, before: int
) -> tuple[nn.Module, dict[str, float]]:
    current = standalone_gloo(store, "g1", run.rank, 2)
    ddp: nn.Module = DistributedDataParallel(run.model, process_group=current)
    formed: dict[str, Any] = {}
    former: threading.Thread | None = None
    while True:
        run.train_step(ddp, 2)
        if run.step == before:
            former = threading.Thread(target=_form, args=(store, run.rank, formed))
            former.start()
        if former is not None and _all_ready(current, "group" in formed, members=2):
            break
    assert former is not None
    former.join()
    # The old group stays referenced until the process exits, so its teardown
    # is not measured here. Dropped in a thread of its own right after the
    # switch it hung this benchmark once, probably in gloo's destructor, which
    # joins its threads with the GIL held (pytorch#56297; training/loop.py's
    # close()). Not confirmed: a store-port race found later hung it too.
    run.retired.append(current)
    del ddp, current
    ddp, parts = _switch(run, formed["group"])
    return ddp, {**parts, "formation_ms": formed["ms"]}


def _all_ready(group: dist.ProcessGroup, ready: bool, *, members: int) -> bool:
    flag = torch.tensor([1.0 if ready else 0.0])
    group.allreduce([flag]).wait()
    return int(flag.item()) == members


def _form(store: dist.Store, rank: int, out: dict[str, Any]) -> None:
    started = time.perf_counter()
    group = standalone_gloo(store, "g2", rank, 3)
    out["ms"] = 1e3 * (time.perf_counter() - started)
    out["group"] = group


def _joiner(run: Run, store: dist.Store, variant: str) -> tuple[nn.Module, dict[str, float]]:
    if variant == "reinit":
        _default_group(store, "g2", 2, 3)
        return _switch(run, None)
    formed: dict[str, Any] = {}
    _form(store, 2, formed)
    return _switch(run, formed["group"])


def worker(rank: int, ports: Any, variant: str, steps: tuple[int, int, float], queue: Any) -> None:
    """One process. Rank 0 binds the store to port 0 and tells the others on
    ``ports``: a port picked free beforehand can be taken meanwhile (it was,
    by the processes of a soak running beside this)."""
    before, after, pace_s = steps
    torch.set_num_threads(1)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=TIMEOUT, wait_for_workers=False)
        for _ in range(2):
            ports.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", ports.get(timeout=120), 3, False, timeout=TIMEOUT)
    run = Run(rank, pace_s=pace_s)
    if rank == 2:
        ddp, parts = _joiner(run, store, variant)
    elif variant == "reinit":
        ddp, parts = _members_reinit(run, store, before)
    else:
        ddp, parts = _members_background(run, store, before)
    # From the switch, not from step 0: the members may step on at 2 for as long
    # as the background formation takes. Every rank has the same step now.
    end = run.step + after
    while run.step < end:
        run.train_step(ddp, 3)
    queue.put({"rank": rank, "times": run.times, "parts": parts, "params": run.params().tolist()})
    queue.close()
    queue.join_thread()  # the result is in the pipe before anything is torn down
    # No teardown: the result is out, and a gloo group's destructor joins its
    # threads with the GIL held, which can deadlock (pytorch#56297).
    os._exit(0)


def member_numbers(times: list[tuple[int, float]], parts: dict[str, float]) -> dict[str, float]:
    """One member's median steps at 2 and 3, its stall (last step at 2 to first
    at 3, less a step at 3), and where the stall went: before the switch
    (reinit: destroying the old default group and forming the new one;
    background: the ready flag's all-reduce), the switch itself (broadcast,
    DDP wrap), and what the first step at 3 took beyond a median one."""
    at2 = [t for world, t in times if world == 2]
    at3 = [t for world, t in times if world == 3]
    step2 = statistics.median(b - a for a, b in itertools.pairwise(at2))
    step3 = statistics.median(b - a for a, b in itertools.pairwise(at3))
    return {
        "step_ms": 1e3 * step2, "step3_ms": 1e3 * step3,
        "stall_ms": 1e3 * (at3[0] - at2[-1] - step3),
        "before_switch_ms": 1e3 * (parts["switch_started"] - at2[-1]),
        "first_step_extra_ms": 1e3 * (at3[0] - parts["switch_done"] - step3),
    }  # fmt: skip


def measure(
    variant: Variant, workdir: Path, *, before: int, after: int, pace_ms: float
) -> dict[str, Any]:
    del workdir  # nothing on disk
    # One server imports torch and forks the ranks of every run: what is measured
    # starts after the imports, which "spawn" paid once per rank (half of a smoke run's CPU).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "torch._dynamo", "torch.nn.parallel", __name__])
    queue, ports = ctx.Queue(), ctx.Queue()
    steps = (before, after, pace_ms / 1e3)
    procs = [
        ctx.Process(target=worker, args=(r, ports, variant.name, steps, queue)) for r in range(3)
    ]
    for proc in procs:
        proc.start()
    try:
        results = sorted((queue.get(timeout=180) for _ in procs), key=lambda r: r["rank"])
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return summarize_run(results)


def summarize_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The members' numbers (the slower member's stall: the group waits for it)."""
    members = [{**r["parts"], **member_numbers(r["times"], r["parts"])} for r in results[:2]]
    worst = max(members, key=lambda m: m["stall_ms"])
    reference = torch.tensor(results[0]["params"])
    diff = max(float((torch.tensor(r["params"]) - reference).abs().max()) for r in results)
    out: dict[str, Any] = {key: worst[key] for key in ("stall_ms", "step_ms", "step3_ms")}
    parts = ("broadcast_ms", "wrap_ms", "formation_ms", "before_switch_ms", "first_step_extra_ms")
    out.update({k: worst.get(k) for k in parts})
    out["switch_ms"] = worst["broadcast_ms"] + worst["wrap_ms"]
    out["stall_steps"] = worst["stall_ms"] / worst["step_ms"]  # the members' step before the join
    out["max_param_diff_between_ranks"] = diff
    out["members"] = members
    return out


def targets(summary: dict[str, dict[str, Any]]) -> list[harness.Target]:
    """The stall in steps at 2 (meaningful with ``--pace-ms`` near a real step)."""
    stall = harness.median_of(summary, "background", "stall_ms")
    step = harness.median_of(summary, "background", "step_ms")
    steps = stall / step if stall is not None and step else None
    return [harness.Target("background: members' stall, steps at 2", steps, TARGET_STALL_STEPS)]


def main(argv: list[str] | None = None) -> None:
    parser = harness.base_parser(__doc__.splitlines()[0], default_repeats=5)
    parser.add_argument("--steps-before", type=int, default=100)
    parser.add_argument("--steps-after", type=int, default=50)
    parser.add_argument("--pace-ms", type=float, default=30.0,
                        help="sleep in every step: the goodput soak's 30 ms step (0: the bare "
                             "3 ms MLP step, where any stall is many steps)")  # fmt: skip
    args = parser.parse_args(argv)
    kwargs: dict[str, Any] = {
        "before": args.steps_before, "after": args.steps_after, "pace_ms": args.pace_ms,
    }  # fmt: skip
    if args.smoke:
        kwargs = {"before": 20, "after": 10, "pace_ms": 0.0}

    def measure_one(variant: Variant, workdir: Path) -> dict[str, Any]:
        return measure(variant, workdir, **kwargs)

    harness.run_benchmark(
        "group_swap_smoke" if args.smoke else "group_swap",
        args,
        list(VARIANTS),
        measure=measure_one,
        metrics=METRICS,
        headline="stall_ms",
        targets=targets,
        settings=kwargs,
        reference="reinit",
    )


if __name__ == "__main__":
    main()
