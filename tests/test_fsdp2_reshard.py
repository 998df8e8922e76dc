"""FSDP2 checkpoints through torch.distributed.checkpoint: saved at world 2, loaded at world 3.

Real gloo process groups (processes from the forkserver of ``tests/workers.py``, CPU) run the
real pieces: ``fsdp.shard_model``, ``ShardedCheckpointManager`` and
``restore.restore_newest``. Each child writes what it saw to a file the test
compares: the full parameters and optimizer state (gathered with
``full_state_dict``) after the load at world 3 must equal those saved at world 2.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch_support import needs_fsdp2
from workers import run_main, start_workers

from elastic_train.config.job import TrainingConfig
from elastic_train.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointWriteError,
)
from elastic_train.etcd.server import free_port
from elastic_train.state.dcp_io import FORMAT, VerifiedReader
from elastic_train.state.restore import restore_newest
from elastic_train.state.sharded import ShardedCheckpointManager
from elastic_train.training.distributed import DistContext, WorkerEnv
from elastic_train.training.fsdp import shard_blocks, shard_model

STEPS = 3


def _model() -> nn.Module:
    # Odd sizes, so that 2 and 3 ranks shard every tensor unevenly.
    torch.manual_seed(11)
    return nn.Sequential(
        nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 13), nn.Tanh(), nn.Linear(13, 5)
    )


def _setup(rank: int, world: int, port: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    env = WorkerEnv(rank=rank, world_size=world, local_world_size=world, launched=True)
    ctx = DistContext(env=env, backend="gloo", device=torch.device("cpu"))
    model = shard_model(_model(), TrainingConfig(parallel="fsdp2"), ctx)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _full(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
    }


def _save_worker(rank: int, world: int, port: int, out: str) -> None:
    model, optimizer = _setup(rank, world, port)
    manager = ShardedCheckpointManager(
        Path(out) / "ckpt", keep=2, fingerprint="f1", async_save=True,
        model=model, optimizer=optimizer,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 5, generator=gen)
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        extra = {"sampler": {"seed": 3, "epoch": 0, "samples_consumed": 6 * step}, "step": step}
        manager.save(step, extra)  # asynchronous: dcp.async_save
    manager.close()
    full = _full(model, optimizer)
    if rank == 0:
        torch.save(full, Path(out) / "saved.pt")
    dist.destroy_process_group()


def _load_worker(rank: int, world: int, port: int, out: str) -> None:
    model, optimizer = _setup(rank, world, port)
    manager = ShardedCheckpointManager(
        Path(out) / "ckpt", keep=2, fingerprint="f1", model=model, optimizer=optimizer
    )
    restored = restore_newest(snapshot=None, checkpoint=manager, group=None, map_location="cpu")
    full = _full(model, optimizer)
    assert restored.state is not None
    seen = {"source": restored.source, "step": restored.step, "rest": restored.state["sampler"]}
    seen["saved_world_size"] = manager.loaded_metadata["world_size"]  # type: ignore[index]
    if rank == 0:
        torch.save(full, Path(out) / "loaded.pt")
    (Path(out) / f"seen-{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


def _assert_same(saved: Any, loaded: Any, where: str) -> None:
    if isinstance(saved, torch.Tensor):
        assert torch.equal(saved, loaded), where
    elif isinstance(saved, dict):
        assert set(saved) == set(loaded), where
        for key in saved:
            _assert_same(saved[key], loaded[key], f"{where}.{key}")
    elif isinstance(saved, (list, tuple)):
        assert len(saved) == len(loaded), where
        for i, (a, b) in enumerate(zip(saved, loaded, strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
    else:
        assert saved == loaded, where


@needs_fsdp2
@pytest.mark.slow
def test_checkpoint_saved_at_world_2_loads_at_world_3_identically(tmp_path: Path) -> None:
    start_workers(_save_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    steps = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert steps == ["step-000000002", "step-000000003"]  # keep = 2; no temporaries left
    newest = tmp_path / "ckpt" / "step-000000003"
    assert {"MANIFEST.json", ".metadata", "state.pt"} <= {p.name for p in newest.iterdir()}

    start_workers(_load_worker, args=(3, free_port(), str(tmp_path)), nprocs=3)
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert saved["optimizer"]["state"], "the optimizer state is part of the comparison"
    _assert_same(saved, loaded, "state")
    for rank in range(3):
        seen = json.loads((tmp_path / f"seen-{rank}.json").read_text())
        assert seen == {
            "source": "disk", "step": STEPS, "saved_world_size": 2,
            "rest": {"seed": 3, "epoch": 0, "samples_consumed": 6 * STEPS},
        }  # fmt: skip


def test_blocks_are_the_elements_of_the_outermost_containers() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2)))
    assert shard_blocks(model) == [model[0], model[2]]  # ReLU holds no parameters

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(4, 2)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(2, 2)) for _ in range(3))

    net = Net()
    assert shard_blocks(net) == list(net.blocks)  # not the Sequential inside each block


def test_metadata_naming_a_foreign_global_is_refused_before_it_is_built(tmp_path: Path) -> None:
    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointCorruptError, match=r"(posix|os)\.system"):
        VerifiedReader(str(tmp_path)).read_metadata()
    assert not (tmp_path / "ran").exists()


@needs_fsdp2
def test_fsdp2_refuses_options_it_does_not_combine_with() -> None:
    from elastic_train.config.job import CheckpointConfig, EvalConfig, JobConfig
    from elastic_train.errors import ConfigError

    cases = [
        ({"comm_hook": "powersgd"}, "training.comm_hook"),
        ({"precision": "fp16"}, "training.precision"),
        ({"compile": True}, "training.compile"),
    ]
    for options, key in cases:
        with pytest.raises(ConfigError, match=re.escape(key)):
            TrainingConfig(parallel="fsdp2", **options)
    fsdp2 = TrainingConfig(parallel="fsdp2")
    with pytest.raises(ConfigError, match=r"eval\.every_steps"):
        JobConfig(training=fsdp2, eval=EvalConfig(every_steps=5))
    with pytest.raises(ConfigError, match=r"checkpoint\.interval_seconds"):
        JobConfig(training=fsdp2, checkpoint=CheckpointConfig(interval_seconds=30.0))
    with pytest.raises(ConfigError, match=r"checkpoint\.resume_from"):
        JobConfig(training=fsdp2, checkpoint=CheckpointConfig(resume_from="run/step-000000008"))
    assert TrainingConfig(comm_hook="powersgd").parallel == "ddp"  # the default is unchanged


def test_a_ddp_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    from elastic_train.state.checkpoint import CheckpointManager
    from elastic_train.state.dcp_io import read_dcp_manifest

    with CheckpointManager(tmp_path, keep=1, fingerprint="f", is_writer=True) as ddp:
        ddp.save(4, {"step": 4}, blocking=True)
    with pytest.raises(CheckpointMismatchError, match=r"training\.parallel = 'ddp'"):
        read_dcp_manifest(tmp_path / "step-000000004", 4)


def test_a_sharded_checkpoint_is_refused_by_name_by_the_ddp_manager(tmp_path: Path) -> None:
    from elastic_train.state.checkpoint import CheckpointManager
    from elastic_train.state.checkpoint_files import write_manifest

    step_dir = tmp_path / "step-000000005"
    step_dir.mkdir()
    body = {"format": FORMAT, "step": 5, "fingerprint": "f", "files": {}, "metadata": {}}
    write_manifest(step_dir, body)
    manager = CheckpointManager(tmp_path, keep=1, fingerprint="f", is_writer=False)
    with pytest.raises(CheckpointMismatchError, match=r"training\.parallel = 'fsdp2'"):
        manager.loadable_steps(limit=1)


def test_fsdp2_needs_torch_2_7(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from elastic_train.errors import ConfigError

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.6.0+cpu")
    with pytest.raises(ConfigError, match=r"training\.parallel = 'fsdp2': needs torch >= 2\.7"):
        TrainingConfig(parallel="fsdp2")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.13.0+cpu")
    assert TrainingConfig(parallel="fsdp2").parallel == "fsdp2"


def test_main_exits_78_on_an_unsupported_fsdp2_option(tmp_path: Path) -> None:
    from elastic_train.errors import EXIT_CONFIG_ERROR

    args = ["--training.parallel=fsdp2", "--training.precision=fp16", "--logging.format=json"]
    proc = run_main([*args, f"--checkpoint.dir={tmp_path}"])  # forked: tests/workers.py
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-2000:]
    assert "training.precision = 'fp16'" in proc.stderr
    assert "process_group_ready" not in proc.stderr  # refused before any process group


@pytest.fixture
def one_rank_group() -> Any:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 5, generator=gen)
    ((model(x) - y) ** 2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@needs_fsdp2
def test_a_failed_or_damaged_save_leaves_the_last_good_checkpoint(
    tmp_path: Path, one_rank_group: None
) -> None:
    ctx = DistContext(env=WorkerEnv(), backend="gloo", device=torch.device("cpu"))
    model = shard_model(_model(), TrainingConfig(parallel="fsdp2"), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    directory = tmp_path / "ckpt"
    manager = ShardedCheckpointManager(
        directory, keep=3, fingerprint="f", model=model, optimizer=optimizer
    )
    _train_step(model, optimizer, 1)
    manager.save(1, {"step": 1}, blocking=True)
    good = _full(model, optimizer)
    _train_step(model, optimizer, 2)

    # A real OS failure: the checkpoint directory's path is a file for one save.
    directory.rename(tmp_path / "aside")
    directory.write_text("not a directory")
    with pytest.raises(CheckpointWriteError, match="step 2"):
        manager.save(2, {"step": 2}, blocking=True)
    manager.save(2, {"step": 2})  # asynchronous: counted, not raised
    assert manager.consecutive_failures == 2
    directory.unlink()
    (tmp_path / "aside").rename(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["step-000000001"]

    # A complete step 2 whose shard file is then damaged: refused, step 1 restored.
    manager.save(2, {"step": 2})
    manager.flush()
    assert manager.consecutive_failures == 0
    shard_file = next((directory / "step-000000002").glob("*.distcp"))
    data = bytearray(shard_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard_file.write_bytes(bytes(data))
    _train_step(model, optimizer, 3)
    restored = restore_newest(snapshot=None, checkpoint=manager, group=None, map_location="cpu")
    assert (restored.source, restored.step) == ("disk", 1)
    _assert_same(good, _full(model, optimizer), "state")
    manager.close()
