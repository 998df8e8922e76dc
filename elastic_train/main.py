"""The torchrun entry script: parse, set up logging, build, train, tear down.

    torchrun --nnodes 1:3 --nproc-per-node 1 --rdzv-backend etcd \\
        --rdzv-endpoint HOST:2379 --rdzv-id job1 elastic_train/main.py --config job.toml

The module form ``python -m elastic_train.main`` (``torchrun ... -m elastic_train.main``)
is the same entry, for an installed package (a wheel, the Docker image) where
no source tree is at hand. Without torchrun it trains as one process.
Exit codes: 0 when training finished, ``errors.EXIT_CONFIG_ERROR`` for a bad
configuration (retrying cannot help), 1 for anything else (torchrun restarts).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run by path, Python puts elastic_train/ itself first on sys.path, where
    # our log.py, metrics.py or config/ would shadow top-level modules of the same
    # name. Put the directory that contains the package there instead.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    # --help reads only the config dataclasses: answer it before torch is
    # imported and before any hand-over, so that it is instant and starts nothing.
    # (Checked on the raw argv first: a worker start must not pay for the import.)
    from elastic_train.config.args import help_requested, help_text

    if help_requested(sys.argv[1:]):
        print(help_text(), end="")
        raise SystemExit(0)

if __name__ == "__main__":
    # Before torch is imported: where the node agent runs a zygote, a forked
    # child that has imported it all already becomes this worker, and this
    # process only relays signals and its exit (docs/warm-start.md).
    from elastic_train.agent.warm_start import hand_over

    hand_over(__file__)  # returns only to start cold

from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import record

from elastic_train.agent.verdict import report_config_error, report_group_formed
from elastic_train.config.args import CliArgs, help_text, parse_cli
from elastic_train.config.job import JobConfig
from elastic_train.config.load import to_toml
from elastic_train.errors import (
    EXIT_CHECKPOINT_FAILURES,
    EXIT_CONFIG_ERROR,
    EXIT_PEER_PREEMPTED,
    CheckpointMismatchError,
    CheckpointWriteError,
    ConfigError,
)
from elastic_train.log import (
    bind_context,
    configure_logging,
    exit_now,
    get_logger,
    json_for_format,
)
from elastic_train.training.admission import joining
from elastic_train.training.distributed import (
    WorkerEnv,
    init_distributed,
    read_worker_env,
    teardown,
    worker_device,
)
from elastic_train.training.loop import Trainer, TrainResult, build, close, train
from elastic_train.training.parts import TrainingParts, prepare
from elastic_train.training.recovery_mode import resolve_recovery

log = get_logger("elastic_train.main")


def _setup_logging(cfg: JobConfig, env: WorkerEnv) -> None:
    configure_logging(level=cfg.logging.level, json=json_for_format(cfg.logging.format))
    bind_context(
        run_id=env.run_id, node=env.node, rank=env.rank, local_rank=env.local_rank,
        world_size=env.world_size,
        restart=env.restart_count,
    )  # fmt: skip


def run(
    cfg: JobConfig, env: WorkerEnv, *, release: bool = True, parts: TrainingParts | None = None
) -> int:
    """Train under ``cfg`` as the worker ``env`` describes; returns the exit code.

    ``release=False`` when the process exits right after (:func:`exit_now`):
    freeing DDP and the process group then only delays the exit (0.2 s here),
    and the agent restarts the group only once every worker is gone.
    """
    outcome = train_worker(cfg, env, release=release, parts=parts)
    return outcome if isinstance(outcome, int) else exit_code(outcome)


def train_worker(
    cfg: JobConfig, env: WorkerEnv, *, release: bool = True, parts: TrainingParts | None = None
) -> TrainResult | int:
    """Build and train; the result, or the exit code of a failure that retrying cannot help.

    ``parts``: the objects of a script's own (:func:`elastic_train.api.fit`);
    None trains what the config names.
    """
    _setup_logging(cfg, env)
    trainer: Trainer | None = None
    try:
        device = worker_device(env, cfg.elastic)
        cfg = resolve_recovery(cfg, backend="nccl" if device.type == "cuda" else "gloo")
        # Model, data and loss are checked before this worker joins any group.
        prepared = prepare(cfg, device, parts)
        ticket = joining(cfg.elastic.recovery)  # a side round's worker: an async join
        ctx = init_distributed(env, cfg.elastic)
        trainer = build(cfg, ctx, prepared=prepared, joining=ticket is not None)
        # Built: the group formed and has run its first collective (the wrapper's).
        report_group_formed()
        return train(trainer)
    except (ConfigError, CheckpointMismatchError) as exc:
        log.error("config_error", error=str(exc))
        report_config_error(str(exc))  # the agent exits instead of restarting this
        return EXIT_CONFIG_ERROR
    except CheckpointWriteError as exc:
        log.error(
            "checkpoint_failures_exceeded", error=str(exc), exit_code=EXIT_CHECKPOINT_FAILURES
        )
        return EXIT_CHECKPOINT_FAILURES
    finally:
        # Also on failure: an in-flight checkpoint holds a consistent earlier step.
        if trainer is not None:
            close(trainer, release_group=release)
        if release:
            teardown()


def exit_code(result: TrainResult) -> int:
    """The worker's exit code after ``train`` returned: 0, unless a peer was preempted."""
    if result.stopped is not None:
        # The signalled worker is done (0); a survivor leaves so that its agent
        # re-forms the group without the preempted node (docs/faults.md).
        code = EXIT_PEER_PREEMPTED if result.stopped == "peer_preempted" else 0
        log.warning("worker_exit_after_preemption", reason=result.stopped, exit_code=code)
        return code
    return 0


def refuse_config(exc: ConfigError) -> int:
    """A bad command line or environment: said on stderr and to the node agent (which
    then exits instead of restarting this worker); the exit code."""
    print(f"elastic_train: configuration error: {exc}", file=sys.stderr)
    report_config_error(str(exc))
    return EXIT_CONFIG_ERROR


@record  # writes torchrun's error file, so the agent reports this worker's traceback
def main(argv: Sequence[str] | None = None, *, release: bool = True) -> int:
    try:
        args: CliArgs = parse_cli(sys.argv[1:] if argv is None else argv)
        env = read_worker_env()
    except ConfigError as exc:
        return refuse_config(exc)
    if args.help:
        print(help_text(), end="")
        return 0
    if args.print_config:
        print(to_toml(args.config), end="")
        return 0
    return run(args.config, env, release=release)


def _main_exit_code() -> int:
    try:
        return main(release=False)  # exit_now follows
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # record() has already written torchrun's error file
        sys.excepthook(*sys.exc_info())
        return 1


if __name__ == "__main__":
    exit_now(_main_exit_code())
