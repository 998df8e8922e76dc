"""The one function a user's own training script calls: :func:`fit`.

    # my_train.py
    from elastic_train.agent.warm_start import hand_over

    hand_over(__file__)  # optional, before torch: warm start; the worker dies with its agent

    import torch
    from elastic_train.api import fit

    model = MyModel()
    fit(
        model=model, dataset=MyDataset(), loss=my_loss,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        config={"model": {"loss_form": "sum_count"}, "training": {"steps": 500}},
    )

Launched like ``elastic_train/main.py`` (``torchrun --rdzv-backend etcd ...
my_train.py``, ``elastic-train local --script my_train.py``, or plain
``python my_train.py`` as one process), it trains with the same loop:
checkpoints, per-step snapshots, restore at any world size, exactly-once
data, the audit records and the metrics. The script's command line is
``main.py``'s (``--config PATH``, ``--SECTION.KEY=VALUE``, ``--print-config``,
``--help``), read on top of ``config``. docs/training.md, "Bring your own".
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import Dataset

from elastic_train.config.args import help_text, parse_cli
from elastic_train.config.job import JobConfig
from elastic_train.config.load import as_dict, load_config, to_toml
from elastic_train.errors import ConfigError
from elastic_train.main import exit_code, refuse_config, train_worker
from elastic_train.training.distributed import read_worker_env
from elastic_train.training.loop import TrainResult
from elastic_train.training.parts import OptimizerFactory, SchedulerFactory, ScriptParts
from elastic_train.workload.datasets import Collate

#: What ``fit(config=...)`` accepts.
ConfigSource = JobConfig | Mapping[str, Mapping[str, Any]] | str | Path | None


def fit(
    *,
    model: nn.Module,
    dataset: Dataset[Any],
    loss: Callable[..., Any],
    optimizer: OptimizerFactory | None = None,
    scheduler: SchedulerFactory | None = None,
    collate_fn: Collate | None = None,
    config: ConfigSource = None,
    argv: Sequence[str] | None = None,
) -> TrainResult:
    """Train ``model`` on ``dataset`` elastically; returns once training is complete.

    * ``loss``: ``loss(model, batch) -> (loss_sum, count)`` with
      ``model.loss_form = "sum_count"``, or ``loss(output, target) -> Tensor[batch]``
      with the default ``"per_sample"`` (docs/training.md, "Bring your own").
    * ``optimizer``: ``factory(model) -> torch.optim.Optimizer``; ``scheduler``:
      ``factory(optimizer) -> LRScheduler``. None: ``optimizer.*``/``schedule.*``
      of the config. Factories, because the trainer builds them on the model it
      trains (on its device, possibly sharded).
    * ``collate_fn``: ``collate(items) -> batch`` of any structure; None: torch's.
    * ``config``: a :class:`JobConfig`, ``{section: {key: value}}`` or a TOML
      path; then ``argv`` (default ``sys.argv[1:]``) as main.py reads it.

    ``model`` is trained in place: after ``fit`` it holds the final weights on
    every rank. When this worker must not go on (a preemption, a peer's
    preemption, a configuration error), ``fit`` does not return: it raises
    ``SystemExit`` with the exit code main.py would give (docs/DESIGN.md), so
    that nothing after it runs on an unfinished model and torchrun reacts as
    it does to main.py. Any other error propagates (torchrun restarts the group).
    """
    try:
        args = parse_cli(sys.argv[1:] if argv is None else argv, base=_base(config))
        parts = ScriptParts(
            args.config, module=model, dataset=dataset, loss_fn=loss,
            optimizer_factory=optimizer, scheduler_factory=scheduler, collate_fn=collate_fn,
        )  # fmt: skip
        env = read_worker_env()
    except ConfigError as exc:
        raise SystemExit(refuse_config(exc)) from exc
    if args.help or args.print_config:
        print(help_text() if args.help else to_toml(args.config), end="")
        raise SystemExit(0)
    outcome = record(train_worker)(args.config, env, parts=parts)
    if isinstance(outcome, int):
        raise SystemExit(outcome)
    if outcome.stopped is not None:
        raise SystemExit(exit_code(outcome))
    return outcome


def _base(config: ConfigSource) -> Mapping[str, Any] | None:
    """``fit(config=...)`` as ``{section: {key: value}}``, checked like a TOML file."""
    if config is None or isinstance(config, Mapping):
        return config
    if isinstance(config, JobConfig):
        return as_dict(config)
    if isinstance(config, (str, Path)):
        return as_dict(load_config(config))
    raise ConfigError(
        f"fit(config=...): got a {type(config).__name__}; expected a JobConfig, "
        "{section: {key: value}} or the path of a TOML file"
    )
