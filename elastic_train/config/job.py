"""The job configuration: one frozen dataclass per component, composed into :class:`JobConfig`.

A configuration is built from the dataclass defaults, then a TOML file, then
``--section.key=value`` overrides, in that order. Every value is checked
against the annotated type of its field, so a typo or a wrong type fails at
start with a :class:`~elastic_train.errors.ConfigError` that names
``section.key`` and what it accepts, instead of deep inside training.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from elastic_train.config.checks import (
    builtin_or_import_string,
    check,
    check_fsdp2,
    parse_signal,
    positive,
)
from elastic_train.errors import ConfigError

#: The optimizers and LR schedules that ``optimizer.name``/``schedule.name`` name
#: without an import string (``training/optim.py`` builds them).
BUILTIN_OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd")
BUILTIN_SCHEDULES: tuple[str, ...] = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class ModelConfig:
    SECTION: ClassVar[str] = "model"
    #: A registered model name or an import string ``package.module:factory``.
    name: str = "char_transformer"
    #: A registered loss name or an import string, of the form ``loss_form`` names.
    loss: str = "cross_entropy"
    #: "per_sample": ``loss(output, target) -> [batch]`` on ``(inputs, target)`` batches.
    #: "sum_count": ``loss(model, batch) -> (loss_sum, count)`` on any batch (docs/training.md).
    loss_form: Literal["per_sample", "sum_count"] = "per_sample"
    #: Width of the built-in models (transformer embedding, MLP hidden layers).
    hidden_size: int = 64
    #: Transformer blocks, or MLP hidden layers.
    num_layers: int = 2
    #: Attention heads (char_transformer); must divide hidden_size.
    num_heads: int = 4
    #: Extra keyword arguments for a custom factory (``--model.options.key=value``).
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        positive(self, "hidden_size", "num_layers", "num_heads")


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
    #: An import string of ``collate(items: list) -> batch``; "": the dataset's
    #: own (``DataBundle.collate_fn``), else torch's ``default_collate``.
    collate_fn: str = ""
    #: Extra settings for a custom dataset factory (--data.options.key=value).
    options: dict[str, Any] = field(default_factory=dict)
    #: DataLoader worker processes that load the coming micro-batches ahead of
    #: the step; 0: load in the training process (docs/training.md, "DataLoader workers").
    num_workers: int = 0
    #: Micro-batches each worker loads ahead (needs num_workers > 0); 0: torch's default, 2.
    prefetch_factor: int = 0
    #: Keep the workers between epochs instead of starting new ones (needs num_workers > 0).
    persistent_workers: bool = False
    #: On CUDA, page-lock batches so the copy to the GPU is asynchronous (in the
    #: DataLoader's pin thread with workers, else just before the copy).
    pin_memory: bool = True
    #: How data is loaded, not what: a resume may change these (not in the fingerprint).
    LOADING_KEYS: ClassVar[tuple[str, ...]] = (
        "num_workers", "prefetch_factor", "persistent_workers", "pin_memory",
    )  # fmt: skip

    def __post_init__(self) -> None:
        positive(self, "num_samples", "num_features", "seq_len")
        check(self, "num_classes", self.num_classes >= 2, "must be >= 2")
        check(self, "collate_fn", not self.collate_fn or ":" in self.collate_fn,
              'expected "" or an import string package.module:function')  # fmt: skip
        check(self, "num_workers", self.num_workers >= 0, "must be >= 0 (0: no workers)")
        check(self, "prefetch_factor", self.prefetch_factor >= 0,
              "must be >= 0 (0: torch's default, 2 per worker)")  # fmt: skip
        without = "needs data.num_workers > 0 (with 0 the training process loads each "
        check(self, "prefetch_factor", self.num_workers > 0 or self.prefetch_factor == 0,
              without + "micro-batch when the step needs it); set it to 0")  # fmt: skip
        check(self, "persistent_workers", self.num_workers > 0 or not self.persistent_workers,
              without + "micro-batch, there are no workers to keep); set it to false")  # fmt: skip


@dataclass(frozen=True)
class TrainingConfig:
    SECTION: ClassVar[str] = "training"
    #: Optimizer steps to run; 0 means run ``epochs`` whole epochs instead.
    #: 800 steps of the default job take 0.06-0.1 s each with 3 workers on
    #: 2 cores (measured), about 60-100 s: long enough for the README's chaos
    #: events at 15 s and 35 s to land mid-run.
    steps: int = 800
    #: Whole epochs to run when steps = 0; one of steps and epochs is > 0.
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
    #: Seeds the initial weights and the per-epoch sample permutation.
    seed: int = 0
    #: "bf16"/"fp16": torch.autocast mixed precision; fp16 adds a checkpointed GradScaler.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    #: DDP gradient compression hook; "fp16" is Horovod's Compression.fp16.
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    powersgd_rank: int = 1  # powersgd only: rank of the gradient approximation
    powersgd_start_iter: int = 10  # powersgd only: plain all-reduce steps first
    #: The final loss is measured on the first this many training samples.
    final_loss_samples: int = 256
    #: torch.compile the model (inductor; needs a C compiler on CPU). Checkpoints
    #: are the same as without; each (re)start compiles again at its first step,
    #: from inductor's on-disk cache after the first (docs/training.md).
    compile: bool = False
    #: torch.compile's mode when compile = true.
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    #: "ddp": DistributedDataParallel, every rank holds the whole model. "fsdp2":
    #: torch's fully_shard (per block, then the root; needs torch >= 2.7) with
    #: torch.distributed.checkpoint checkpoints that resume at any world size;
    #: no per-step snapshots (docs/training.md, "FSDP2").
    parallel: Literal["ddp", "fsdp2"] = "ddp"

    def __post_init__(self) -> None:
        check(self, "steps", self.steps >= 0, "must be >= 0")
        check(self, "epochs", self.epochs >= 0, "must be >= 0")
        check(
            self, "steps", (self.steps > 0) != (self.epochs > 0),
            "exactly one of training.steps and training.epochs must be > 0",
        )  # fmt: skip
        positive(self, "global_batch_size", "worker_batch_size", "final_loss_samples")
        positive(self, "powersgd_rank", "powersgd_start_iter")
        check(self, "micro_batch_size", self.micro_batch_size >= 0, "must be >= 0 (0: no limit)")
        if self.parallel == "fsdp2":
            check_fsdp2(self)

    def total_steps(self, *, dataset_len: int, batch_size: int) -> int:
        return self.steps or self.epochs * -(-dataset_len // batch_size)  # a short last batch too


@dataclass(frozen=True)
class OptimizerConfig:
    SECTION: ClassVar[str] = "optimizer"
    #: "adamw", "sgd", or an import string of ``factory(model, **options) -> Optimizer``
    #: (then lr, weight_decay, momentum, beta1, beta2 and eps are the factory's business).
    name: str = "adamw"
    #: The learning rate of the whole global batch (of one worker in per_worker mode).
    lr: float = 3e-3
    #: Decoupled (AdamW) or L2 (SGD) weight decay.
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    beta1: float = 0.9  # adamw only
    beta2: float = 0.99  # adamw only
    #: AdamW's epsilon.
    eps: float = 1e-8
    #: Clip the global gradient norm to this value; 0 disables clipping.
    grad_clip: float = 1.0
    #: The built-in optimizers' kernels: "auto" is AdamW's fused kernel where torch has
    #: it for every parameter (CPU, CUDA; not FSDP2 shards), torch's default otherwise.
    implementation: Literal["auto", "for-loop", "foreach", "fused"] = "auto"
    #: Keyword arguments for an optimizer factory (``--optimizer.options.key=value``).
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        builtin_or_import_string(self, "name", BUILTIN_OPTIMIZERS)
        positive(self, "lr", "eps")
        check(self, "weight_decay", self.weight_decay >= 0, "must be >= 0")
        check(self, "grad_clip", self.grad_clip >= 0, "must be >= 0 (0: off)")


@dataclass(frozen=True)
class ScheduleConfig:
    SECTION: ClassVar[str] = "schedule"
    #: "constant", "cosine", "linear", or an import string of
    #: ``factory(optimizer, **options) -> LRScheduler`` (stepped after every optimizer step).
    name: str = "cosine"
    #: Linear warmup from lr/warmup_steps to lr.
    warmup_steps: int = 20
    #: The LR decays to lr * min_lr_ratio at the last step (cosine, linear).
    min_lr_ratio: float = 0.1
    #: Keyword arguments for a scheduler factory (``--schedule.options.key=value``).
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        builtin_or_import_string(self, "name", BUILTIN_SCHEDULES)
        check(self, "warmup_steps", self.warmup_steps >= 0, "must be >= 0")
        check(self, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]")


@dataclass(frozen=True)
class CheckpointConfig:
    SECTION: ClassVar[str] = "checkpoint"
    #: Checkpoint directory; "" disables checkpoints (and so resuming).
    dir: str = "checkpoints"
    #: Save every this many steps; 0 disables the step trigger.
    interval_steps: int = 25
    #: Save when this many seconds passed since the last save; 0 disables it.
    interval_seconds: float = 0.0
    #: Complete checkpoints to keep.
    keep: int = 3
    #: Write in a background thread; the loop waits only for the host copy.
    async_save: bool = True
    #: Exit (code errors.EXIT_CHECKPOINT_FAILURES) after this many failed saves in a row.
    max_consecutive_failures: int = 3
    #: Who writes the disk checkpoint: "trainer" (a thread of rank 0), "agent" (the
    #: node agent persists rank 0's /dev/shm snapshot, off the training process; without
    #: a node agent or snapshots it falls back to "trainer", logged once) or "auto":
    #: "agent" where the node agent and the snapshots are there, else "trainer", quietly.
    writer: Literal["auto", "trainer", "agent"] = "auto"
    #: Start from these weights only (no optimizer, no step): one of our checkpoint
    #: (step) directories, a .safetensors or state_dict file, or a Hugging Face model
    #: directory. Used when the run has no state of its own yet.
    init_from: str = ""
    #: Resume the full state of this checkpoint step directory instead of starting
    #: fresh; ignored once this run's own state is at or past its step.
    resume_from: str = ""
    #: At the end of a successful run rank 0 writes model.safetensors and model.pt
    #: (a plain state dict) here; "": no export.
    export_dir: str = ""

    def __post_init__(self) -> None:
        positive(self, "max_consecutive_failures")
        check(self, "interval_steps", self.interval_steps >= 0, "must be >= 0 (0: off)")
        check(self, "interval_seconds", self.interval_seconds >= 0, "must be >= 0 (0: off)")
        positive(self, "keep")
        check(self, "init_from", not (self.init_from and self.resume_from),
              "set init_from (weights only) or resume_from (full state), not both")  # fmt: skip


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
    #: See watchdog_timeout_seconds.
    watchdog_multiple: float = 10.0
    #: See watchdog_timeout_seconds.
    watchdog_floor_seconds: float = 60.0
    #: The limit before the first step and during saves and evaluations.
    watchdog_startup_seconds: float = 600.0
    #: Besides SIGTERM, the signal that means "save and leave" (Slurm --signal=USR1@90).
    preemption_signal: str = "SIGUSR1"
    #: Agree on the preemption flag every this many steps; 0: about every 0.25 s
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
    #: Max step-time share for snapshots; see snapshot_every_steps.
    snapshot_max_overhead: float = 0.02
    #: When a step fails (a peer died mid all-reduce), write the state of the
    #: last completed step before exiting, so the failure loses at most the
    #: failed step whatever the cadence (docs/checkpoints-and-snapshots.md).
    snapshot_on_failure: bool = True
    #: Most MiB the two snapshot slots of a node may take; 0: the free space of /dev/shm.
    snapshot_max_mib: float = 0.0
    #: After a peer's failure: "auto" (the default): in process where that is
    #: known to work, else restart (training/recovery_mode.py lists the
    #: conditions; the log line ``recovery_mode`` says which ran); "inprocess"
    #: (survivors re-form the group through etcd without a restart; needs our
    #: etcd rendezvous and torch >= 2.8, docs/recovery-inprocess.md) or "restart" (every worker
    #: exits and torchrun's agent restarts the group).
    recovery: Literal["restart", "inprocess", "auto"] = "auto"
    #: In-process recovery: re-forms tried per failure (a peer failing during one
    #: adds one), and failures in a row without a completed step, before the worker
    #: exits to the restart path.
    inprocess_max_reforms: int = 3
    #: In-process recovery: seconds a liveness probe waits for a peer's answer. A dead
    #: peer refuses at once; this is how long a live but starved one may take.
    inprocess_probe_seconds: float = 1.0
    #: In-process recovery: inside a step the process group's timeout is
    #: max(inprocess_timeout_floor_seconds, this x the median step time), below
    #: pg_timeout_seconds and half the watchdog's, so a survivor that gloo leaves
    #: waiting for a failed peer recovers in a few steps; 0: pg_timeout_seconds.
    inprocess_timeout_multiple: float = 10.0
    #: See inprocess_timeout_multiple. Also the timeout of a re-form's state
    #: transfer (training/rollback.py), which must fit each 16 MiB piece.
    inprocess_timeout_floor_seconds: float = 5.0
    #: In-process recovery: seconds a node entering the running group (an async
    #: join) waits to be admitted at a step boundary before it exits to the
    #: restart path (the group's steps, checkpoint saves and evaluations run first).
    inprocess_join_timeout_seconds: float = 300.0
    #: In-process async joins: the joiners receive the state while the members
    #: take the next step, which gives the joiners an empty share of its batch
    #: (training/heal.py), instead of a broadcast that every member waits for.
    heal_joins: bool = True

    def __post_init__(self) -> None:
        positive(self, "pg_timeout_seconds", "watchdog_multiple", "watchdog_floor_seconds")
        positive(self, "watchdog_startup_seconds")
        check(self, "preemption_check_every", self.preemption_check_every >= 0,
              "must be >= 0 (0: adaptive)")  # fmt: skip
        check(self, "snapshot_every_steps", self.snapshot_every_steps >= 0,
              "must be >= 0 (0: adaptive)")  # fmt: skip
        check(self, "snapshot_max_overhead", 0 < self.snapshot_max_overhead <= 1,
              "must be in (0, 1]")  # fmt: skip
        check(self, "snapshot_max_mib", self.snapshot_max_mib >= 0, "must be >= 0 (0: no limit)")
        check(self, "inprocess_max_reforms", self.inprocess_max_reforms >= 1, "must be >= 1")
        positive(self, "inprocess_probe_seconds", "inprocess_timeout_floor_seconds")
        positive(self, "inprocess_join_timeout_seconds")
        check(self, "inprocess_timeout_multiple", self.inprocess_timeout_multiple >= 0,
              "must be >= 0 (0: pg_timeout_seconds throughout)")  # fmt: skip
        check(self, "watchdog_timeout_seconds", self.watchdog_timeout_seconds >= 0,
              "must be >= 0 (0: adaptive)")  # fmt: skip
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
        check(self, "every_steps", self.every_steps >= 0, "must be >= 0 (0: off)")
        check(self, "max_samples", self.max_samples >= 0, "must be >= 0 (0: all)")
        positive(self, "batch_size")


@dataclass(frozen=True)
class LoggingConfig:
    SECTION: ClassVar[str] = "logging"
    #: Log level (torch's logs too).
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    #: "auto": JSON lines unless stderr is a terminal.
    format: Literal["auto", "json", "console"] = "auto"
    #: A "step" line at the first preemption check at or after every this many
    #: steps: the line carries the global loss, which the ranks agree on there.
    log_every_steps: int = 10
    #: Directory for the per-step audit records (docs/DESIGN.md); "" disables them.
    audit_dir: str = ""
    #: TensorBoard event files (rank 0, by step; the ``tensorboard`` extra); "": none.
    tensorboard_dir: str = ""
    #: Comma-separated import strings of tracker factories ``factory(cfg) -> Tracker``
    #: (training/tracking.py), used on rank 0 besides TensorBoard.
    trackers: str = ""

    def __post_init__(self) -> None:
        positive(self, "log_every_steps")
        specs = [spec.strip() for spec in self.trackers.split(",") if spec.strip()]
        check(self, "trackers", all(":" in spec for spec in specs),
              "expected comma-separated import strings package.module:factory")  # fmt: skip


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

    def __post_init__(self) -> None:
        inprocess_ok = (self.training.parallel, self.training.batch_mode) == ("ddp", "global")
        if self.elastic.recovery == "inprocess" and not inprocess_ok:
            raise ConfigError(
                "elastic.recovery = 'inprocess' needs training.parallel = 'ddp' and "
                "training.batch_mode = 'global' (a step that does not depend on the world size)"
            )
        if self.training.parallel != "fsdp2":
            return
        # Evaluation splits samples unevenly over ranks, and a sharded forward is a
        # collective; a DCP save is a collective too, and each rank's clock would
        # decide interval_seconds alone; resume_from loads a DDP checkpoint's full state.
        refused = (
            ("checkpoint.interval_seconds", self.checkpoint.interval_seconds, "set it to 0"),
            ("eval.every_steps", self.eval.every_steps, "set it to 0"),
            ("eval.at_end", self.eval.at_end, "set it to false"),
            ("checkpoint.resume_from", self.checkpoint.resume_from, 'set it to ""'),
        )
        for key, value, fix in refused:
            if value:
                raise ConfigError(
                    f"{key} = {value!r} is not supported with training.parallel = 'fsdp2' "
                    f"yet; {fix}"
                )


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # type: ignore[misc]


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
    values = dataclasses.asdict(cfg)
    picked = {}
    for name in FINGERPRINT_FIELDS:
        section, _, key = name.partition(".")
        picked[name] = values[section][key] if key else values[section]
    for key in DataConfig.LOADING_KEYS:  # also keeps fingerprints from before these keys
        picked.get("data", {}).pop(key, None)
    canonical = json.dumps(picked, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
