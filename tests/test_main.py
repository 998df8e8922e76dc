"""``elastic_train/main.py`` as users run it: by path, alone or under torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tomllib
import torch
from torch.multiprocessing import ProcessExitedException
from trainer_procs import TINY_JOB, final_params, run_workers

from elastic_train.config.args import help_text
from elastic_train.config.load import from_dict, load_config
from elastic_train.errors import EXIT_CONFIG_ERROR, ConfigError
from elastic_train.main import main, run
from elastic_train.training.distributed import WorkerEnv, read_worker_env, wait_for_listener

REPO = Path(__file__).resolve().parents[1]
MAIN = REPO / "elastic_train" / "main.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
STEPS = 6
TIMEOUT = 120
# main() is decorated with torchrun's @record, which wants a real stderr fd.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")


def _args(*overrides: str) -> list[str]:
    return [f"--{o}" for o in (*TINY_JOB, *overrides)]


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))}
    env.update(OMP_NUM_THREADS="1", ELASTIC_TRAIN_NODE="node0")
    return subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )


def _records(audit: Path, kind: str) -> list[dict]:
    lines = [line for p in sorted(audit.glob("worker-*.jsonl")) for line in p.read_text().split()]
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_print_config_shows_the_effective_configuration(capsys: pytest.CaptureFixture) -> None:
    assert main(["--print-config", "--training.steps=3", "--local-rank=1"]) == 0
    printed = capsys.readouterr().out
    assert from_dict(tomllib.loads(printed)) == load_config(None, ["training.steps=3"])


def test_help_lists_every_config_key_and_exits_0(capsys: pytest.CaptureFixture) -> None:
    # Called as a function (as the zygote's worker would): the same text as the
    # early --help of `python -m elastic_train.main`, tested in test_help_config.py.
    assert main(["--config", "no-such.toml", "--help"]) == 0
    printed = capsys.readouterr().out
    assert printed == help_text()
    assert "[elastic]\n" in printed and "  snapshot: bool = true\n" in printed


def test_a_bad_value_exits_with_the_config_error_code(capsys: pytest.CaptureFixture) -> None:
    assert main(["--training.global_batch_size=many"]) == EXIT_CONFIG_ERROR
    assert "training.global_batch_size = 'many': expected an integer" in capsys.readouterr().err


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python elastic_train/main.py`` without torchrun; its audit directory.

    Checkpoints go to ``checkpoints/`` in the working directory (the default).
    """
    cwd = tmp_path_factory.mktemp("single")
    done = _run(
        [sys.executable, str(MAIN), *_args(f"training.steps={STEPS}", "logging.audit_dir=audit")],
        cwd,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return cwd / "audit"


@pytest.mark.slow
def test_runs_as_one_process_without_torchrun(single_process_run: Path) -> None:
    audit = single_process_run
    result = json.loads((audit / "result.json").read_text())
    assert (result["final_step"], result["world_size"]) == (STEPS, 1)
    steps = _records(audit, "step")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    consumed = [i for r in steps for i in r["indices"]]
    assert len(consumed) == 16 * STEPS == len(set(consumed))  # epoch 0: no sample twice
    assert (audit.parent / "checkpoints" / f"step-{STEPS:09d}" / "MANIFEST.json").exists()


@pytest.mark.slow
def test_a_changed_model_does_not_resume_from_the_checkpoint(single_process_run: Path) -> None:
    ckpt = f"checkpoint.dir={single_process_run.parent / 'checkpoints'}"
    with pytest.raises(ProcessExitedException) as info:
        run_workers(1, [*TINY_JOB, "training.steps=9", "model.hidden_size=8", ckpt])
    assert info.value.exit_code == EXIT_CONFIG_ERROR


@pytest.mark.slow
def test_torchrun_standalone_two_workers(tmp_path: Path, single_process_run: Path) -> None:
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(MAIN),
           *_args(f"training.steps={STEPS}", "logging.audit_dir=audit")]  # fmt: skip
    done = _run(cmd, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    audit = tmp_path / "audit"
    assert json.loads((audit / "result.json").read_text())["world_size"] == 2
    steps = _records(audit, "step")
    assert sorted((r["step"], r["rank"]) for r in steps) == [
        (s, r) for s in range(1, STEPS + 1) for r in (0, 1)
    ]
    # Each global batch is split between the ranks, as in the single-process run.
    alone = {r["step"]: r["indices"] for r in _records(single_process_run, "step")}
    for step in range(1, STEPS + 1):
        shards = sorted((r["rank"], r["indices"]) for r in steps if r["step"] == step)
        assert shards[0][1] + shards[1][1] == alone[step]
    expected = final_params(single_process_run)
    for name, value in final_params(audit).items():
        torch.testing.assert_close(value, expected[name], atol=2e-6, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="NCCL is valid where CUDA is")
def test_nccl_without_cuda_is_a_config_error() -> None:
    assert run(load_config(None, ["elastic.backend=nccl"]), WorkerEnv()) == EXIT_CONFIG_ERROR


def test_more_workers_than_the_global_batch_exit_with_the_config_error_code() -> None:
    with pytest.raises(ProcessExitedException) as info:
        run_workers(3, [*TINY_JOB, "training.global_batch_size=2", "checkpoint.dir="])
    assert info.value.exit_code == EXIT_CONFIG_ERROR


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"WORLD_SIZE": "two", "MASTER_ADDR": "h"}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h"}, "RANK=2 is outside WORLD_SIZE=2"),
        ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR is not"),
    ],
)
def test_a_malformed_worker_environment_names_the_variable(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        read_worker_env(environ)


def test_worker_environment_from_torchrun() -> None:
    env = read_worker_env(
        {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
         "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "job7",
         "MASTER_ADDR": "h", "ELASTIC_TRAIN_NODE": "node1"}
    )  # fmt: skip
    assert env == WorkerEnv(
        rank=3, local_rank=1, world_size=4, local_world_size=2, restart_count=2,
        run_id="job7", node="node1", launched=True,
    )  # fmt: skip
    assert not read_worker_env({}).launched


def test_a_rank_waits_for_rank_0s_store_to_listen() -> None:
    """Ranks other than 0 poll for rank 0's TCPStore before joining, instead of
    falling into the store client's 0.7 s back-off when they start first."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    started = time.monotonic()
    assert not wait_for_listener("127.0.0.1", port, timeout=0.2)  # bound, not listening
    assert time.monotonic() - started >= 0.2
    outcome: list[bool] = []
    waiter = threading.Thread(
        target=lambda: outcome.append(wait_for_listener("127.0.0.1", port, timeout=30))
    )
    waiter.start()
    server.listen()
    waiter.join(timeout=30)
    server.close()
    assert outcome == [True]
