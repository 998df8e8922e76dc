"""Distributed evaluation, mixed precision and DDP communication hooks.

The distributed cases run real gloo process groups (processes from the forkserver
of ``tests/workers.py``, CPU); each child writes its results to a file the test compares.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset
from workers import run_main, start_workers

from elastic_train.errors import ConfigError
from elastic_train.etcd.server import free_port
from elastic_train.training.comm_hooks import CommHook
from elastic_train.training.evaluate import evaluate, micro_batches
from elastic_train.training.precision import Precision

N_EVAL = 203  # prime-ish, so shards are uneven and the last micro-batch is short


def _eval_data() -> tuple[torch.nn.Module, TensorDataset]:
    gen = torch.Generator().manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    x = torch.randn(N_EVAL, 16, generator=gen)
    y = torch.randint(0, 5, (N_EVAL,), generator=gen)
    return model, TensorDataset(x, y)


def _loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output, target, reduction="none")


def _init(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )


def _eval_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    # The CPU kernels' blocking depends on the thread count, and with it the last
    # bits of a forward pass: pin it so every process computes what the parent does.
    torch.set_num_threads(1)
    _init(rank, world, port)
    model, data = _eval_data()
    results = {}
    for size in (world, 2):
        group = dist.new_group(list(range(size)))  # a collective: every rank calls it
        if rank < size:
            result = evaluate(
                model,
                data,
                loss_fn=_loss_fn,
                batch_size=16,
                rank=rank,
                world_size=size,
                group=group,
            )
            results[size] = result.as_dict()
    torch.save(results, Path(out_dir) / f"eval-{rank}.pt")
    dist.destroy_process_group()


def test_micro_batches_cover_every_sample_once() -> None:
    batches = micro_batches(N_EVAL, 16)
    assert [i for b in batches for i in b] == list(range(N_EVAL))
    assert len(batches[-1]) == N_EVAL % 16
    with pytest.raises(ValueError, match="batch_size"):
        micro_batches(10, 0)


@pytest.mark.slow
def test_distributed_evaluation_equals_single_process_exactly(tmp_path: Path) -> None:
    model, data = _eval_data()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in _eval_worker
    try:
        single = evaluate(model, data, loss_fn=_loss_fn, batch_size=16)
    finally:
        torch.set_num_threads(threads)
    # An independent plain computation, to check the metric itself.
    logits = model(data.tensors[0])
    assert single.samples == N_EVAL
    assert single.correct == int((logits.argmax(1) == data.tensors[1]).sum())
    plain = float(_loss_fn(logits, data.tensors[1]).detach().double().mean())
    assert math.isclose(single.loss, plain, rel_tol=1e-6)

    start_workers(_eval_worker, args=(3, free_port(), str(tmp_path)), nprocs=3)
    per_rank = [torch.load(tmp_path / f"eval-{r}.pt", weights_only=True) for r in range(3)]
    for size in (3, 2):
        reported = [per_rank[r][size] for r in range(size)]
        for result in reported:
            # Bit-identical, not merely close: same micro-batches, exact sum reduction.
            assert result == single.as_dict(), size


def test_bf16_autocast_on_cpu_and_fp32_passthrough() -> None:
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with Precision("bf16", device="cpu").autocast():
        assert layer(x).dtype == torch.bfloat16
    with Precision("fp32", device="cpu").autocast():
        assert layer(x).dtype == torch.float32
    assert Precision("bf16", device="cpu").state_dict() == {"precision": "bf16"}
    with pytest.raises(ConfigError, match=r"precision='fp8'.*fp32, bf16, fp16"):
        Precision("fp8", device="cpu")


def test_fp16_scaler_skips_overflow_and_its_state_round_trips() -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision("fp16", device="cpu")
    with precision.autocast():
        out = model(torch.randn(2, 4))
    assert out.dtype == torch.float16
    before = [p.detach().clone() for p in model.parameters()]
    precision.backward(out.float().sum() * float("inf"))
    assert precision.step(optimizer) is False  # overflow: step skipped, scale backed off
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    optimizer.zero_grad()
    precision.backward(model(torch.randn(2, 4)).sum())
    assert precision.step(optimizer) is True
    assert not torch.equal(before[0], model.weight)

    buffer = io.BytesIO()
    torch.save(precision.state_dict(), buffer)
    buffer.seek(0)
    restored = Precision("fp16", device="cpu")
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.scaler is not None and precision.scaler is not None
    assert restored.scaler.get_scale() == precision.scaler.get_scale() == 2.0**15
    # A bf16 run ignores an fp16 checkpoint's scaler state instead of failing.
    Precision("bf16", device="cpu").load_state_dict(precision.state_dict())


HOOKS = ("none", "fp16", "bf16", "powersgd")


def _hook_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    for hook in HOOKS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        )
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        comm = CommHook(hook, powersgd_start_iter=2)
        comm.register(ddp)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
        for _ in range(5):
            optimizer.zero_grad()
            ddp(torch.randn(8, 32, generator=gen)).pow(2).mean().backward()
            optimizer.step()
        buffer = io.BytesIO()
        torch.save(comm.state_dict(), buffer)
        # A restore happens before DDP wrapping: the state waits for register().
        resumed = CommHook(hook, powersgd_start_iter=2)
        resumed.load_state_dict(comm.state_dict())
        resumed.register(torch.nn.parallel.DistributedDataParallel(model))
        assert resumed.state_dict() == comm.state_dict()
        torch.save(
            {"params": [p.detach() for p in model.parameters()], "state": buffer.getvalue()},
            Path(out_dir) / f"{hook}-{rank}.pt",
        )
    dist.destroy_process_group()


@pytest.mark.slow
def test_comm_hooks_keep_replicas_identical_and_close(tmp_path: Path) -> None:
    start_workers(_hook_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    results = {
        hook: [torch.load(tmp_path / f"{hook}-{r}.pt", weights_only=True) for r in range(2)]
        for hook in HOOKS
    }
    for hook, ranks in results.items():
        for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
            assert torch.equal(a, b), hook  # the hook all-reduced: replicas agree exactly
        for a, b in zip(ranks[0]["params"], results["none"][0]["params"], strict=True):
            # Compression changes the numbers a little, not the training.
            torch.testing.assert_close(a, b, rtol=0.05, atol=0.02, msg=hook)
        state = torch.load(io.BytesIO(ranks[0]["state"]), weights_only=True)
        assert state["name"] == hook
    powersgd = torch.load(io.BytesIO(results["powersgd"][0]["state"]), weights_only=True)
    assert powersgd == {"name": "powersgd", "powersgd_iter": 5}


def test_comm_hook_rejects_unknown_names() -> None:
    with pytest.raises(ConfigError, match=r"comm_hook='int8'.*none, fp16, bf16, powersgd"):
        CommHook("int8")


@pytest.mark.slow
def test_trainer_checkpoints_scaler_and_powersgd_state(tmp_path: Path) -> None:
    """fp16 autocast with a GradScaler and PowerSGD, through the real trainer: both
    states are in the checkpoint (weights_only) and a resume continues from them."""
    pytest.importorskip("numpy")
    directory = tmp_path / "ckpt"
    job = [
        "--model.name=mlp",
        "--data.name=synthetic", "--data.num_samples=64", "--training.global_batch_size=16",
        "--training.precision=fp16", "--training.comm_hook=powersgd",
        "--training.powersgd_start_iter=2", "--checkpoint.interval_steps=3",
        f"--checkpoint.dir={directory}", "--logging.format=json",
    ]  # fmt: skip
    first = run_main([*job, "--training.steps=6"])  # python -m elastic_train.main, forked
    assert first.returncode == 0, first.stderr[-3000:]
    state = torch.load(directory / "step-000000006" / "state.pt", weights_only=True)
    assert state["precision"]["precision"] == "fp16"
    assert state["precision"]["scaler"]["scale"] > 0
    assert state["comm_hook"] == {"name": "powersgd", "powersgd_iter": 6}
    resumed = run_main([*job, "--training.steps=9"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert '"restored_step": 6' in resumed.stderr
    final = torch.load(directory / "step-000000009" / "state.pt", weights_only=True)
    assert final["comm_hook"]["powersgd_iter"] == 9  # continued, not restarted at 0
