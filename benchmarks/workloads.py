"""The training workload every competitor runs, and the runner spec that
makes each competitor's script run exactly that workload."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_train.local.cluster import MAIN_SCRIPT, ClusterSpec

if TYPE_CHECKING:
    from benchmarks.harness import Competitor

#: For every competitor: one intra-op thread per worker (fewer cores than
#: workers here), and torch's agents logging at INFO, which is where their
#: "Worker group FAILED" / "Rendezvous complete" lines (the breakdown) are.
BENCH_ENV = (("OMP_NUM_THREADS", "1"), ("LOGLEVEL", "INFO"))

PLAIN_SCRIPT = Path(__file__).resolve().parent / "competitors" / "plain_ddp.py"

#: False: each node's agent starts as an interpreter of its own, as on a cluster, and
#: a node that joins pays its own imports. True: forked from one launcher that imported
#: torch once, as ``elastic-train local`` does. tests/test_benchmarks_smoke.py sets it:
#: a smoke run's numbers are not results, and its CPU is the suite's (28 of the
#: goodput smoke's 82 s).
FORK_AGENTS = False


@dataclass(frozen=True)
class Workload:
    """elastic_train's ``mlp`` on its ``synthetic`` data; both scripts build these."""

    steps: int = 1_000_000
    global_batch_size: int = 64
    num_features: int = 32
    num_classes: int = 8
    hidden_size: int = 256
    num_layers: int = 2
    num_samples: int = 65536
    #: The checkpoint interval in steps: elastic_train's default, given to the plain script.
    ckpt_every: int = 25
    #: Extra ``--section.key=value`` overrides for elastic_train only.
    ours_overrides: tuple[str, ...] = ()
    #: A sleep per forward in both scripts (0: none), so that a step costs wall time
    #: but little CPU: on fewer cores than workers the step rate then no longer
    #: depends on the world size, and what a fault costs stands out.
    step_seconds: float = 0.0


def shared_args(workload: Workload) -> list[str]:
    """The overrides both scripts understand (the plain script mirrors our flag names)."""
    return [
        f"--training.steps={workload.steps}",
        f"--training.global_batch_size={workload.global_batch_size}",
        f"--model.hidden_size={workload.hidden_size}",
        f"--model.num_layers={workload.num_layers}",
        f"--data.num_samples={workload.num_samples}",
        f"--data.num_features={workload.num_features}",
        f"--data.num_classes={workload.num_classes}",
    ]


def ours_args(workload: Workload) -> list[str]:
    model = ["--model.name=mlp"]
    if workload.step_seconds:  # main.py puts the repository root on sys.path
        model = ["--model.name=tests.paced_model:paced_mlp",
                 f"--model.options.seconds={workload.step_seconds}"]  # fmt: skip
    return [
        *model,
        "--model.loss=cross_entropy",
        "--data.name=synthetic",
        *shared_args(workload),
        *workload.ours_overrides,
    ]


def plain_args(workload: Workload) -> list[str]:
    return [
        *shared_args(workload),
        *([f"--pace-seconds={workload.step_seconds}"] if workload.step_seconds else []),
        f"--checkpoint.interval_steps={workload.ckpt_every}",
        "--checkpoint.dir={checkpoint_dir}",
        "--logging.audit_dir={audit_dir}",
    ]


def cluster_spec(
    competitor: Competitor, workload: Workload, *, rdzv_endpoint: str | None, **spec: Any
) -> ClusterSpec:
    """The runner spec for ``competitor``; ``spec`` are ClusterSpec fields (nodes, ...)."""
    conf = competitor.rdzv_conf
    if competitor.rdzv_backend == "c10d":
        conf = f"{conf},is_host=0" if conf else "is_host=0"
    script, args = (
        (str(MAIN_SCRIPT), ours_args(workload))
        if competitor.ours
        else (str(PLAIN_SCRIPT), plain_args(workload))
    )
    env = (*BENCH_ENV, *competitor.env, *spec.pop("env", ()))
    return ClusterSpec(
        script=script,
        script_args=tuple(args),
        trainer_args=competitor.ours,
        rdzv_backend=competitor.rdzv_backend,
        rdzv_conf=conf,
        rdzv_endpoint=rdzv_endpoint,
        env=env,
        # Teardown between repetitions: the benchmark has its numbers by then.
        grace_s=0.5,
        fork_agents=FORK_AGENTS,
        **spec,
    )
