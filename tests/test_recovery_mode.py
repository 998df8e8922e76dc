"""``elastic.recovery = "auto"``: in process exactly where it is known to work.

The decision is a pure function of the config, the backend and the environment
the torchrun plugin hands its workers, so it is tested here as one; the end to
end run with ``auto`` (a kill re-formed in process under ``elastic-train local``)
is ``test_inprocess.test_survivors_keep_their_processes_through_a_kill_and_a_rank0_kill``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch_support import needs_fsdp2

from elastic_train.config.job import JobConfig
from elastic_train.config.load import load_config
from elastic_train.errors import ConfigError
from elastic_train.etcd.codec import SECRET_ENV
from elastic_train.training.etcd_access import ETCD_ENV, EtcdAccess
from elastic_train.training.recovery_mode import resolve_recovery, restart_reason

SECRET = "s" * 32
#: a torch that can recover in process, whichever runs these tests (the floor: 2.6)
TORCH = "2.13.0"


def _handover(**fields: object) -> str:
    return EtcdAccess(endpoints=("127.0.0.1:2379",), prefix="/et/job", **fields).to_env()  # type: ignore[arg-type]


def _auto(*overrides: str) -> JobConfig:
    return load_config(None, ["elastic.recovery=auto", *overrides])


def test_auto_is_in_process_under_our_plugin_with_a_secret_and_gloo() -> None:
    environ = {ETCD_ENV: _handover(), SECRET_ENV: SECRET}
    cfg = resolve_recovery(_auto(), backend="gloo", environ=environ, torch_version=TORCH)
    assert cfg.elastic.recovery == "inprocess"
    # The rest of the job is untouched, and a concrete choice is left alone.
    assert cfg.training == _auto().training
    restart = load_config(None, ["elastic.recovery=restart"])
    assert (
        resolve_recovery(restart, backend="gloo", environ=environ, torch_version=TORCH) is restart
    )


def test_a_secret_file_or_an_insecure_rendezvous_count_as_signed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    for environ in (
        {ETCD_ENV: _handover(secret_file=str(secret))},
        {ETCD_ENV: _handover(insecure=True)},
    ):
        assert restart_reason(_auto(), backend="gloo", environ=environ, torch_version=TORCH) is None


@pytest.mark.parametrize(
    ("overrides", "backend", "environ", "named"),
    [
        ((), "gloo", {SECRET_ENV: SECRET}, ETCD_ENV),
        ((), "gloo", {ETCD_ENV: _handover()}, "secret"),
        ((), "nccl", {ETCD_ENV: _handover(), SECRET_ENV: SECRET}, "nccl"),
        (("training.batch_mode=per_worker",), "gloo",
         {ETCD_ENV: _handover(), SECRET_ENV: SECRET}, "per_worker"),
        pytest.param(("training.parallel=fsdp2",), "gloo",
                     {ETCD_ENV: _handover(), SECRET_ENV: SECRET}, "fsdp2", marks=needs_fsdp2),
    ],
    ids=["no-torchrun-plugin", "no-secret", "nccl", "per-worker-batches", "fsdp2"],
)  # fmt: skip
def test_auto_falls_back_to_restart_and_says_why(
    overrides: tuple[str, ...], backend: str, environ: dict[str, str], named: str
) -> None:
    cfg = _auto(*overrides)
    reason = restart_reason(cfg, backend=backend, environ=environ, torch_version=TORCH)
    assert reason is not None and named in reason
    assert (
        resolve_recovery(
            cfg, backend=backend, environ=environ, torch_version=TORCH
        ).elastic.recovery
        == "restart"
    )


@pytest.mark.parametrize("version", ["2.6.0+cu124", "2.7.1"])
def test_a_torch_older_than_2_8_runs_the_restart_path_or_refuses_inprocess(version: str) -> None:
    # Below 2.8 a gloo group's destroy holds the GIL; a re-form deadlocked on 2.6.
    environ = {ETCD_ENV: _handover(), SECRET_ENV: SECRET}
    reason = restart_reason(_auto(), backend="gloo", environ=environ, torch_version=version)
    assert reason is not None and f"torch {version}" in reason and ">= 2.8" in reason
    cfg = resolve_recovery(_auto(), backend="gloo", environ=environ, torch_version=version)
    assert cfg.elastic.recovery == "restart"
    explicit = load_config(None, ["elastic.recovery=inprocess"])
    with pytest.raises(ConfigError, match=r"elastic.recovery = 'inprocess'.*>= 2.8.*'restart'"):
        resolve_recovery(explicit, backend="gloo", environ=environ, torch_version=version)
    for newer in ("2.8.0", "2.13.0+cpu"):
        assert restart_reason(_auto(), backend="gloo", environ=environ, torch_version=newer) is None


def test_an_unusable_secret_is_an_error_not_a_quiet_fallback(tmp_path: Path) -> None:
    # A secret that is there but broken is a mistake to report: the rendezvous
    # itself refuses it too, so falling back would hide it.
    short = tmp_path / "short"
    short.write_text("too short")
    for environ, named in (
        ({ETCD_ENV: _handover(secret_file=str(short))}, "at least 32 bytes"),
        ({ETCD_ENV: _handover(secret_file=str(tmp_path / "missing"))}, "cannot be read"),
        ({ETCD_ENV: "{not json"}, f"{ETCD_ENV} is malformed"),
    ):
        with pytest.raises(ConfigError, match=named):
            restart_reason(_auto(), backend="gloo", environ=environ, torch_version=TORCH)


@needs_fsdp2
def test_auto_with_fsdp2_loads_but_an_explicit_inprocess_is_refused() -> None:
    assert _auto("training.parallel=fsdp2").elastic.recovery == "auto"
    with pytest.raises(ConfigError, match=r"elastic\.recovery.*training\.parallel"):
        load_config(None, ["elastic.recovery=inprocess", "training.parallel=fsdp2"])
