"""The job configuration: one frozen dataclass per component, composed into :class:`JobConfig`.

A configuration is built from the dataclass defaults, then a TOML file, then
``--section.key=value`` overrides, in that order. Every value is checked
against the annotated type of its field, so a typo or a wrong type fails at
start with a :class:`~elastic_train.errors.ConfigError` that names
``section.key`` and what it accepts, instead of deep inside training.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args, get_origin, get_type_hints

from elastic_train.errors import ConfigError
from elastic_train.state_io import config_fingerprint

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib


@dataclass(frozen=True)
class ModelConfig:
    SECTION: ClassVar[str] = "model"
    #: A registered model name or an import string ``package.module:factory``.
    name: str = "char_transformer"
    #: A registered loss name or an import string; returns one loss per sample.
    loss: str = "cross_entropy"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    #: Extra keyword arguments for a custom factory (``--model.options.key=value``).
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive(self, "hidden_size", "num_layers", "num_heads")


@dataclass(frozen=True)
class DataConfig:
    SECTION: ClassVar[str] = "data"
    #: A registered dataset name or an import string ``package.module:factory``.
    name: str = "founding_documents"
    #: Seed of the data itself (synthetic samples), not of the sample order.
    seed: int = 1234
    num_samples: int = 2048  # synthetic only
    num_features: int = 32  # synthetic only
    num_classes: int = 8  # synthetic only
    seq_len: int = 64  # character language model only
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive(self, "num_samples", "num_features", "seq_len")
        _check(self, "num_classes", self.num_classes >= 2, "must be >= 2")


@dataclass(frozen=True)
class TrainingConfig:
    SECTION: ClassVar[str] = "training"
    #: Optimizer steps to run; 0 means run ``epochs`` whole epochs instead.
    #: 800 steps of the default job take 0.06-0.1 s each with 3 workers on
    #: 2 cores (measured), about 60-100 s: long enough for the README's chaos
    #: events at 15 s and 35 s to land mid-run.
    steps: int = 800
    epochs: int = 0
    #: Samples per optimizer step summed over all workers (``batch_mode = "global"``).
    global_batch_size: int = 32
    #: Most samples one forward pass sees; larger shards are gradient-accumulated.
    micro_batch_size: int = 32
    #: Samples per worker per step (``batch_mode = "per_worker"`` only).
    worker_batch_size: int = 16
    #: "global": the global batch is fixed, results do not depend on the world size.
    #: "per_worker": each worker takes worker_batch_size and the LR scales linearly.
    batch_mode: Literal["global", "per_worker"] = "global"
    seed: int = 0
    #: "bf16"/"fp16": torch.autocast mixed precision; fp16 adds a checkpointed GradScaler.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    #: DDP gradient compression hook; "fp16" is Horovod's Compression.fp16.
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    powersgd_rank: int = 1  # powersgd only: rank of the gradient approximation
    powersgd_start_iter: int = 10  # powersgd only: plain all-reduce steps first
    #: The final loss is measured on the first this many training samples.
    final_loss_samples: int = 256

    def __post_init__(self) -> None:
        _check(self, "steps", self.steps >= 0, "must be >= 0")
        _check(self, "epochs", self.epochs >= 0, "must be >= 0")
        _check(
            self, "steps", (self.steps > 0) != (self.epochs > 0),
            "exactly one of training.steps and training.epochs must be > 0",
        )  # fmt: skip
        _positive(self, "global_batch_size", "worker_batch_size", "final_loss_samples")
        _positive(self, "powersgd_rank", "powersgd_start_iter")
        _check(self, "micro_batch_size", self.micro_batch_size >= 0, "must be >= 0 (0: no limit)")


@dataclass(frozen=True)
class OptimizerConfig:
    SECTION: ClassVar[str] = "optimizer"
    name: Literal["adamw", "sgd"] = "adamw"
    #: The learning rate of the whole global batch (of one worker in per_worker mode).
    lr: float = 3e-3
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    beta1: float = 0.9  # adamw only
    beta2: float = 0.99  # adamw only
    eps: float = 1e-8
    #: Clip the global gradient norm to this value; 0 disables clipping.
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _positive(self, "lr", "eps")
        _check(self, "weight_decay", self.weight_decay >= 0, "must be >= 0")
        _check(self, "grad_clip", self.grad_clip >= 0, "must be >= 0 (0: off)")


@dataclass(frozen=True)
class ScheduleConfig:
    SECTION: ClassVar[str] = "schedule"
    name: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: int = 20
    #: The LR decays to lr * min_lr_ratio at the last step (cosine, linear).
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        _check(self, "warmup_steps", self.warmup_steps >= 0, "must be >= 0")
        _check(self, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]")


@dataclass(frozen=True)
class CheckpointConfig:
    SECTION: ClassVar[str] = "checkpoint"
    #: Checkpoint directory; "" disables checkpoints (and so resuming).
    dir: str = "checkpoints"
    #: Save every this many steps; 0 disables the step trigger.
    interval_steps: int = 25
    #: Save when this many seconds passed since the last save; 0 disables it.
    interval_seconds: float = 0.0
    keep: int = 3
    async_save: bool = True
    #: Exit (code errors.EXIT_CHECKPOINT_FAILURES) after this many failed saves in a row.
    max_consecutive_failures: int = 3

    def __post_init__(self) -> None:
        _positive(self, "max_consecutive_failures")
        _check(self, "interval_steps", self.interval_steps >= 0, "must be >= 0 (0: off)")
        _check(self, "interval_seconds", self.interval_seconds >= 0, "must be >= 0 (0: off)")
        _positive(self, "keep")


@dataclass(frozen=True)
class ElasticConfig:
    SECTION: ClassVar[str] = "elastic"
    #: "auto": NCCL when CUDA is available, gloo otherwise.
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    #: Process-group timeout. A hung peer is only noticed after it, and torch's
    #: defaults (30 min gloo, 10 min NCCL) would stall the whole job that long.
    #: 60 s is far above any collective of a healthy step here.
    pg_timeout_seconds: float = 60.0
    #: Kill a worker whose steps stop (stacks to the log, exit errors.EXIT_HANG).
    watchdog: bool = True
    #: Seconds without a completed step; 0: max(watchdog_floor_seconds,
    #: watchdog_multiple x the median step time).
    watchdog_timeout_seconds: float = 0.0
    watchdog_multiple: float = 10.0
    watchdog_floor_seconds: float = 60.0
    #: The limit before the first step and during saves and evaluations.
    watchdog_startup_seconds: float = 600.0
    #: Besides SIGTERM, the signal that means "save and leave" (Slurm --signal=USR1@90).
    preemption_signal: str = "SIGUSR1"
    #: Agree on the preemption flag every this many steps; 0: about every 50 ms
    #: (every step for slow steps; fast ones skip the collective).
    preemption_check_every: int = 0
    #: Copy the training state into /dev/shm after optimizer steps (one writer per
    #: node), so a failure loses at most the steps since the last copy
    #: (docs/checkpoints-and-snapshots.md). Off: disk checkpoints only.
    snapshot: bool = True
    #: Snapshot at multiples of this many steps; 0: every step while a copy
    #: (its save and the slowdown of the two steps after it) costs at most
    #: snapshot_max_overhead of the step time, else at multiples of the
    #: smallest power of two that stays within it (so that nodes line up).
    snapshot_every_steps: int = 0
    snapshot_max_overhead: float = 0.02
    #: When a step fails (a peer died mid all-reduce), write the state of the
    #: last completed step before exiting, so the failure loses at most the
    #: failed step whatever the cadence (docs/checkpoints-and-snapshots.md).
    snapshot_on_failure: bool = True
    #: Most MiB the two snapshot slots of a node may take; 0: the free space of /dev/shm.
    snapshot_max_mib: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "pg_timeout_seconds", "watchdog_multiple", "watchdog_floor_seconds")
        _positive(self, "watchdog_startup_seconds")
        _check(self, "preemption_check_every", self.preemption_check_every >= 0,
               "must be >= 0 (0: adaptive)")  # fmt: skip
        _check(self, "snapshot_every_steps", self.snapshot_every_steps >= 0,
               "must be >= 0 (0: adaptive)")  # fmt: skip
        _check(self, "snapshot_max_overhead", 0 < self.snapshot_max_overhead <= 1,
               "must be in (0, 1]")  # fmt: skip
        _check(self, "snapshot_max_mib", self.snapshot_max_mib >= 0, "must be >= 0 (0: no limit)")
        _check(self, "watchdog_timeout_seconds", self.watchdog_timeout_seconds >= 0,
               "must be >= 0 (0: adaptive)")  # fmt: skip
        from elastic_train.preemption import parse_signal  # lazily: it imports torch

        parse_signal(self.preemption_signal)


@dataclass(frozen=True)
class EvalConfig:
    SECTION: ClassVar[str] = "eval"
    #: Evaluate every this many steps; 0: never during training.
    every_steps: int = 0
    #: Evaluate once more after the last step.
    at_end: bool = False
    #: A registered dataset name or an import string; "": the training dataset.
    dataset: str = ""
    #: Samples per forward pass; also the unit that is split across ranks.
    batch_size: int = 64
    #: Evaluate the first this many samples; 0: all of them.
    max_samples: int = 0

    def __post_init__(self) -> None:
        _check(self, "every_steps", self.every_steps >= 0, "must be >= 0 (0: off)")
        _check(self, "max_samples", self.max_samples >= 0, "must be >= 0 (0: all)")
        _positive(self, "batch_size")


@dataclass(frozen=True)
class LoggingConfig:
    SECTION: ClassVar[str] = "logging"
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    #: "auto": JSON lines unless stderr is a terminal.
    format: Literal["auto", "json", "console"] = "auto"
    #: A "step" line at the first preemption check at or after every this many
    #: steps: the line carries the global loss, which the ranks agree on there.
    log_every_steps: int = 10
    #: Directory for the per-step audit records (docs/DESIGN.md); "" disables them.
    audit_dir: str = ""

    def __post_init__(self) -> None:
        _positive(self, "log_every_steps")


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # type: ignore[misc]


def _check(component: Any, key: str, ok: bool, message: str) -> None:
    if not ok:
        value = getattr(component, key)
        raise ConfigError(f"{component.SECTION}.{key} = {value!r}: {message}")


def _positive(component: Any, *keys: str) -> None:
    for key in keys:
        _check(component, key, getattr(component, key) > 0, "must be > 0")


# -- building from TOML and overrides -----------------------------------------


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Defaults, then the TOML file at ``path``, then ``section.key=value`` overrides."""
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    if path is not None:
        _merge(values, _read_toml(Path(path)), source=str(path))
    for item in overrides:
        section, key, sub, raw = _split_override(item)
        expected = _field_types(SECTIONS[section])[key]
        value = _parse_override(f"{section}.{key}", raw, expected, sub)
        if sub is None:
            values[section][key] = value
        else:
            values[section].setdefault(key, {})[sub] = value
    return from_dict(values)


def from_dict(values: Mapping[str, Mapping[str, Any]]) -> JobConfig:
    """Build a validated :class:`JobConfig` from ``{section: {key: value}}``."""
    components = {}
    for section, items in values.items():
        cls = _section_class(section)
        types = _field_types(cls)
        checked = {}
        for key, value in items.items():
            if key not in types:
                raise ConfigError(f"unknown key {section}.{key}; known keys: {', '.join(types)}")
            checked[key] = _check_type(f"{section}.{key}", value, types[key])
        components[section] = cls(**checked)
    return JobConfig(**components)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def _merge(values: dict[str, dict[str, Any]], data: Mapping[str, Any], *, source: str) -> None:
    for section, items in data.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"unknown section [{section}] in {source}; known sections: {', '.join(SECTIONS)}"
            )
        if not isinstance(items, dict):
            raise ConfigError(f"{section} in {source} must be a table [{section}]")
        values[section].update(items)


def _section_class(section: str) -> type:
    if section not in SECTIONS:
        raise ConfigError(f"unknown section {section!r}; known sections: {', '.join(SECTIONS)}")
    return SECTIONS[section]


def _field_types(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _split_override(item: str) -> tuple[str, str, str | None, str]:
    name, sep, raw = item.partition("=")
    parts = name.split(".")
    if not sep or len(parts) not in (2, 3):
        raise ConfigError(f"override {item!r} must look like section.key=value")
    section, key = parts[0], parts[1]
    types = _field_types(_section_class(section))
    if key not in types:
        raise ConfigError(f"unknown key {section}.{key}; known keys: {', '.join(types)}")
    sub = parts[2] if len(parts) == 3 else None
    if sub is not None and get_origin(types[key]) is not dict:
        raise ConfigError(f"{section}.{key} is not a table; use --{section}.{key}=value")
    return section, key, sub, raw


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _describe(expected: Any) -> str:
    if get_origin(expected) is Literal:
        return "one of " + ", ".join(repr(c) for c in get_args(expected))
    if get_origin(expected) is dict:
        return "a table"
    return _TYPE_NAMES.get(expected, expected.__name__)


def _parse_override(name: str, raw: str, expected: Any, sub: str | None) -> Any:
    if sub is not None or expected is Any:
        # Option tables hold whatever a custom factory takes: read the value as a
        # TOML literal (3, 0.5, true, "x"), and as a plain string otherwise.
        try:
            return tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            return raw
    try:
        if expected is bool:
            lowered = raw.strip().lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return lowered in ("true", "1", "yes")
        if expected is int:
            return int(raw)
        if expected is float:
            return float(raw)
    except ValueError:
        raise ConfigError(f"{name} = {raw!r}: expected {_describe(expected)}") from None
    if get_origin(expected) is dict:
        raise ConfigError(f"{name} is a table; set its keys with --{name}.KEY=VALUE")
    return raw


def _check_type(name: str, value: Any, expected: Any) -> Any:
    origin = get_origin(expected)
    if origin is Literal:
        ok = value in get_args(expected)
    elif origin is dict:
        ok = isinstance(value, dict)
        value = dict(value) if ok else value
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise ConfigError(f"{name} = {value!r}: expected {_describe(expected)}")
    return value


# -- output -------------------------------------------------------------------


def as_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, dict):
        inner = ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{" + inner + "}" if inner else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def to_toml(cfg: JobConfig) -> str:
    """The effective configuration as TOML that :func:`load_config` reads back."""
    lines: list[str] = []
    for section, items in as_dict(cfg).items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in items.items())
        lines.append("")
    return "\n".join(lines)


#: What a checkpoint's meaning depends on. A resume under a different value
#: would load tensors into the wrong shapes or replay a different sample order.
#: World size, batch split, intervals, LR schedule and logging may change.
FINGERPRINT_FIELDS: tuple[str, ...] = (
    "model",
    "data",
    "training.seed",
    "training.batch_mode",
    "training.global_batch_size",
    "training.worker_batch_size",
    "optimizer.name",
)


def fingerprint(cfg: JobConfig) -> str:
    """A short hash of :data:`FINGERPRINT_FIELDS`; stored in and checked against checkpoints."""
    values = as_dict(cfg)
    picked = {}
    for name in FINGERPRINT_FIELDS:
        section, _, key = name.partition(".")
        picked[name] = values[section][key] if key else values[section]
    return config_fingerprint(picked)


# -- command line -------------------------------------------------------------

USAGE = """\
usage: main.py [--config PATH] [--print-config] [--SECTION.KEY=VALUE ...]

  --config PATH          TOML file with [section] tables (see docs/training.md)
  --print-config         print the effective configuration as TOML and exit
  --SECTION.KEY=VALUE    override one field, e.g. --training.steps=100
  --local-rank N         accepted and ignored: LOCAL_RANK comes from the environment
"""

_LEGACY_LOCAL_RANK = ("--local_rank", "--local-rank")


@dataclass(frozen=True)
class CliArgs:
    config: JobConfig
    print_config: bool = False
    help: bool = False


def parse_cli(argv: Sequence[str]) -> CliArgs:
    """Parse ``main.py``'s arguments; raises :class:`ConfigError` naming the bad one."""
    path: str | None = None
    overrides: list[str] = []
    flags = {"print_config": False, "help": False}
    args = list(argv)
    while args:
        arg = args.pop(0)
        name, has_value, value = arg.partition("=")
        if arg in ("-h", "--help"):
            flags["help"] = True
        elif arg == "--print-config":
            flags["print_config"] = True
        elif name in ("--config", *_LEGACY_LOCAL_RANK):
            if not has_value:
                if not args:
                    raise ConfigError(f"{name} needs a value")
                value = args.pop(0)
            if name == "--config":
                path = value
        elif arg.startswith("--") and "." in name:
            if not has_value:
                if not args:
                    raise ConfigError(f"{name} needs a value")
                value = args.pop(0)
            overrides.append(f"{name[2:]}={value}")
        else:
            raise ConfigError(f"unknown argument {arg!r}; expected --SECTION.KEY=VALUE\n{USAGE}")
    if flags["help"]:
        return CliArgs(config=JobConfig(), help=True)
    return CliArgs(config=load_config(path, overrides), print_config=flags["print_config"])
