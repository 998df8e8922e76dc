"""A model that shows where each worker is in its gradient all-reduce, for the fault tests.

``--model.name=fault_hooks:probe_mlp`` is the built-in MLP plus two probes:

- every rank but rank 0 sleeps ``model.options.allreduce_pause_s`` right before
  its gradient all-reduce starts, so rank 0 spends nearly all of each step
  *inside* the all-reduce, waiting for the others: a kill of rank 0's node at
  any moment lands there (a sleep costs no CPU and changes no number); a world
  of one sleeps too, so the pace holds to the end;
- with ``model.options.probe_dir`` each worker appends a line when its
  all-reduce starts (``enter``: the last parameter's gradient is computed, so
  DDP launches its bucket now) and when it ended (``exit``: the optimizer step
  begins, which DDP lets happen only once the all-reduce finished). A worker
  whose last line is ``enter`` died inside its all-reduce.

``model.options.pause_file``: where it holds a number, that replaces
``allreduce_pause_s`` from the next step on (read at every step), so a test ends
the pace once the faults played out: the steps left are only wall time.

``model.options.hold_at_step`` and ``hold_s``: in the first start's processes
(their steps count from 1), the others pause ``hold_s`` instead at that step.
Every rank records a step in the audit before its all-reduce, so a kill
triggered by that step (``kill:rank0@stepN``, N = hold_at_step) lands inside
rank 0's all-reduce however late the runner's look comes.

``model.options.ballast_mib`` adds a frozen parameter of that many MiB of
zeros: the checkpoint writes take long enough for a kill to catch one in flight
(``kill:rank0@save``); it never changes, so it changes no other number.

``model.options.die_sending_state``: a path. The first rank 0 whose state is
read for an in-process state transfer (``rollback.take_newest``: an admission's
broadcast to a joiner) writes it (the time, its node) and, before the state
leaves, kills its node (the torchrun agent, then itself), or with
``model.options.sending_state_fault=stop`` SIGSTOPs itself: its sockets stay open.
With ``sending_state_fault=kill_healing`` the first rank 0 in the first step of
a larger group (a joiner heals in it: rank 0 has posted its sends of the state,
``training/heal.py``) kills its node instead, at its last gradient, before the
step's all-reduce.

``model.options.stop_first_step_at_world``: a world size N, with
``model.options.stop_marker``, a path. The first rank 1 to reach its gradient
all-reduce in a group of N after steps in a group of another size (the first
step after a re-form that changed the world size) writes the marker (the time,
its node) and SIGSTOPs itself there, once per run: rank 0 waits inside the
all-reduce of a group's first step, where nothing but the collective's timeout
wakes it.

``model.options.wait_dir``: gates a test opens by creating files there. With
``model.options.wait_at_steps`` (steps, comma-separated), every rank but rank 0
of the first start's processes waits at each of those steps, before its
all-reduce, until ``go-<step>`` exists. An async joiner
(``training/admission.py``) writes ``joiner-waiting`` at its warm-up's backward
and waits there until ``go-joiner`` exists (so it asks to join then), and at its
exit (``log.on_exit_now``) saves its model's state to ``joiner-final.pt``.

``model.options.die_before_group``: a marker path. The first worker of rank > 0
of a first start to build its model writes the marker (the time, its node) and
kills its node there, before its process group forms: once per run.

The probe needs one backward per step (``training.micro_batch_size=0``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from elastic_train.config.job import ModelConfig
from elastic_train.local.agent_forks import LAUNCHER_PID_ENV
from elastic_train.log import on_exit_now
from elastic_train.training.admission import ASYNC_JOIN_ENV
from elastic_train.workload.models import mlp

#: how long a gate of ``wait_dir`` may stay shut before the worker gives up
_GATE_TIMEOUT_S = 120.0

#: the probe file of this process (one per worker process: restarts get new ones)
_probe_file: Path | None = None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _mark(event: str) -> None:
    if _probe_file is None:
        return
    line = {"event": event, "rank": _rank(), "node": os.environ.get("ELASTIC_TRAIN_NODE"),
            "pid": os.getpid(), "time": time.time()}  # fmt: skip
    with _probe_file.open("a") as out:
        out.write(json.dumps(line) + "\n")


def _on_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _mark("exit")


def probe_mlp(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    """The registry's ``mlp`` with the all-reduce probes of this module's docstring."""
    global _probe_file
    model = mlp(cfg, info)
    ballast = int(float(cfg.options.get("ballast_mib", 0)) * 2**20 / 4)
    if ballast:
        model.register_parameter("ballast", nn.Parameter(torch.zeros(ballast), requires_grad=False))
    pause = float(cfg.options.get("allreduce_pause_s", 0.0))
    pause_file = Path(str(cfg.options["pause_file"])) if cfg.options.get("pause_file") else None
    probe_dir = str(cfg.options.get("probe_dir", ""))
    if probe_dir:
        Path(probe_dir).mkdir(parents=True, exist_ok=True)
        if _probe_file is None:  # one global hook per process
            register_optimizer_step_pre_hook(_on_optimizer_step)
        node = os.environ.get("ELASTIC_TRAIN_NODE", "single")
        _probe_file = Path(probe_dir) / f"probe-{node}-{os.getpid()}.jsonl"
    fault, heal_marker = cfg.options.get("sending_state_fault", "kill"), None
    if cfg.options.get("die_sending_state"):
        marker = Path(str(cfg.options["die_sending_state"]))
        if fault == "kill_healing":
            heal_marker = marker
        else:
            stop = fault == "stop"
            model.register_state_dict_pre_hook(lambda *_: _die_if_sending_state(marker, stop=stop))
    if cfg.options.get("die_before_group"):
        _die_before_group(Path(str(cfg.options["die_before_group"])))
    params = [p for p in model.parameters() if p.requires_grad]
    seen, steps = [0], [0]
    hold_at, hold = int(cfg.options.get("hold_at_step", 0)), float(cfg.options.get("hold_s", 0))
    first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    stop_world, worlds = int(cfg.options.get("stop_first_step_at_world", 0)), [0]
    stop_marker = Path(str(cfg.options.get("stop_marker", "stop-marker")))
    gates = _gates(cfg.options, model)

    def on_grad(grad: torch.Tensor) -> torch.Tensor:
        # A tensor hook runs before the gradient is accumulated, so before
        # DDP's own hook on it: at the last one the bucket is not launched yet.
        seen[0] += 1
        if seen[0] == len(params):
            seen[0], steps[0] = 0, steps[0] + 1
            world, before = _world_size(), worlds[0]
            worlds[0] = world
            first_after_reform = before not in (0, world)
            if stop_world == world and first_after_reform and _rank() == 1 and _claim(stop_marker):
                os.kill(os.getpid(), signal.SIGSTOP)
            grown = first_after_reform and world > before and _rank() == 0
            if heal_marker is not None and grown and _claim(heal_marker):
                _kill_node()
            if gates is not None:
                gates(steps[0], first_start=first_start)
            held = hold if steps[0] == hold_at and first_start else _paced(pause, pause_file)
            if held and (_rank() != 0 or _world_size() == 1):
                time.sleep(held)  # a world of one keeps the pace, with no all-reduce to wait in
            _mark("enter")
        return grad

    for param in params:
        param.register_hook(on_grad)
    return model


def _gates(options: Mapping[str, Any], model: nn.Module) -> Callable[..., None] | None:
    """``wait_dir``'s gates (the module docstring), called at each step's last gradient."""
    if not options.get("wait_dir"):
        return None
    directory = Path(str(options["wait_dir"]))
    at_steps = {int(s) for s in str(options.get("wait_at_steps", "")).split(",") if s}
    joiner = ASYNC_JOIN_ENV in os.environ
    if joiner:
        on_exit_now(lambda code: torch.save(model.state_dict(), directory / "joiner-final.pt"))

    def wait(step: int, *, first_start: bool) -> None:
        if joiner and step == 1:  # the warm-up, before the request to join
            (directory / "joiner-waiting").touch()
            _wait_for(directory / "go-joiner")
        elif first_start and step in at_steps and _rank() != 0:
            _wait_for(directory / f"go-{step}")

    return wait


def _wait_for(gate: Path) -> None:
    deadline = time.monotonic() + _GATE_TIMEOUT_S
    while not gate.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test never opened {gate}")
        time.sleep(0.02)


def _die_if_sending_state(marker: Path, *, stop: bool) -> None:
    if _rank() != 0 or not _in_function("take_newest"):
        return
    if not _claim(marker):
        return  # once per run: the next holder sends
    if stop:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    _kill_node()


def _die_before_group(marker: Path) -> None:
    """A worker of rank > 0 of the first start kills its node while it builds its model,
    before its process group: once per run (``marker``)."""
    first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_start and os.environ.get("RANK", "0") != "0" and _claim(marker):
        _kill_node()


def _kill_node() -> None:
    # The node dies, not only this worker: its agent, and the zygote forked from it
    # (the same command line), top down, before the agent can restart anything.
    tree = _node_ancestors()
    for process in reversed(tree):
        process.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def _node_ancestors() -> list[psutil.Process]:
    """This worker's agent and zygote: up to the launcher that forked the agent
    (``elastic-train local``), else those with torchrun's command line."""
    parents = psutil.Process().parents()
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is not None:
        return list(itertools.takewhile(lambda p: p.pid != int(launcher), parents))
    return [p for p in parents if "torch.distributed.run" in p.cmdline()]


def _claim(marker: Path) -> bool:
    """Write ``marker`` (the time, this node and pid) unless it exists: the fault's
    once per run, and when and where it struck."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    node = os.environ.get("ELASTIC_TRAIN_NODE")
    os.write(fd, json.dumps({"time": time.time(), "node": node, "pid": os.getpid()}).encode())
    os.close(fd)
    return True


def _in_function(name: str) -> bool:
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _paced(default: float, pause_file: Path | None) -> float:
    if pause_file is not None:
        with contextlib.suppress(OSError, ValueError):
            return float(pause_file.read_text())
    return default


def probe_lines(probe_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Each worker process's probe lines, by file name (``probe-<node>-<pid>``)."""
    return {path.stem: _parsed(path) for path in sorted(probe_dir.glob("probe-*.jsonl"))}


def _parsed(path: Path) -> list[dict[str, Any]]:
    lines = []
    for text in path.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except ValueError:
            continue  # a line torn by the kill: the writer died while appending it
    return lines
