"""The ``elastic-train`` console script: a thin shell over the library API.

    elastic-train --version
    elastic-train local [--nodes N] [--nproc-per-node K] [--chaos SCHEDULE]
                        [--json PATH] [--run-dir DIR] [--print-config] [--script PATH]
                        [--log-format auto|json|console] [--SECTION.KEY=VALUE ...]
    elastic-train spawn --nproc N [--SECTION.KEY=VALUE ...]
    elastic-train rdzv reset --endpoint HOST:PORT --run-id ID [--key-prefix PREFIX]
    elastic-train export SOURCE OUT_DIR

Arguments this parser does not know are the trainer's own (``--config PATH``
and ``--SECTION.KEY=VALUE`` overrides); they are checked by the trainer's
config parser before any process starts. ``elastic-train local --help`` lists
every one of them (:func:`~elastic_train.config.describe.describe_config`), and
every subcommand takes ``--log-format``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import textwrap
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from types import FrameType

from elastic_train.agent import metrics_endpoint
from elastic_train.config.describe import describe_config
from elastic_train.errors import ConfigError, ElasticTrainError
from elastic_train.launch import add_rdzv_subcommand, add_spawn_subcommand
from elastic_train.log import LOG_FORMATS, configure_logging, get_logger, json_for_format

log = get_logger(__name__)

EXIT_OK = 0
#: the run finished but did not complete, or the exactly-once audit failed
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _add_local(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "local",
        help="run the job on a local cluster: embedded etcd + N torchrun agents",
        description=textwrap.fill(
            "Run elastic_train/main.py on N local torchrun 'nodes' against an embedded "
            "etcd, optionally with a chaos schedule, and audit the result. Unknown "
            "arguments (--config PATH, --SECTION.KEY=VALUE) go to the trainer; the keys "
            "they can set are listed below."
        ),
        epilog=describe_config(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=int, default=3, help="agents started at once (default 3)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers per agent (default 1)")
    p.add_argument("--min-nodes", type=int, default=1, help="MIN of --nnodes MIN:MAX (default 1)")
    p.add_argument(
        "--max-nodes", type=int, default=None, help="MAX of --nnodes (default: nodes + joiners)"
    )
    p.add_argument(
        "--chaos",
        default="",
        help="comma-separated KIND:NODE@WHEN events; KIND kill|join|term|stop, WHEN 20s "
        "(seconds after start) or step30 (once step 30 is done), e.g. kill:1@20s,join:1@40s",
    )
    p.add_argument("--json", metavar="PATH", help="write the JSON summary here")
    p.add_argument(
        "--run-dir", metavar="DIR", help="audit, checkpoints, logs (default: a temp dir)"
    )
    p.add_argument("--rdzv-backend", default="etcd", help="torchrun --rdzv-backend (default etcd)")
    p.add_argument(
        "--rdzv-conf",
        default="",
        help="torchrun --rdzv-conf (default: the backend's); the etcd backends get "
        "secret_file=RUN_DIR/rdzv-secret, a secret made for this run, unless this gives "
        "secret_file or insecure=true (docs/security.md)",
    )
    p.add_argument(
        "--metrics-port",
        type=_metrics_port,
        default=DEFAULT_METRICS_PORT,
        help=f"node i serves metrics on 127.0.0.1:PORT+i (default {DEFAULT_METRICS_PORT}, as "
        "deploy/prometheus expects); 0 picks free ports, 'off' serves none",
    )
    p.add_argument(
        "--script",
        metavar="PATH",
        default=None,
        help="your own training script that calls elastic_train.api.fit, run instead of "
        "elastic_train/main.py; it gets the same arguments (docs/training.md, 'Your own "
        "script'). Add --rdzv-conf warm_start=1 if it calls hand_over(__file__)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before giving up")
    p.add_argument(
        "--finish-grace",
        type=float,
        default=15.0,
        help="seconds the nodes get to exit once training finished, then they are stopped "
        "(default 15)",
    )
    p.add_argument("--quiet", action="store_true", help="no live progress")
    p.add_argument(
        "--no-timeline",
        dest="timeline",
        action="store_false",
        help="do not draw RUN_DIR/timeline.png at the end (it takes matplotlib a second or "
        "two); summary.json is written either way",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the trainer's effective config as TOML (the runner's own settings "
        "included) and exit; starts nothing",
    )
    p.set_defaults(handler=_run_local)


#: the metrics endpoint's default port; node i of a local cluster gets this + i
DEFAULT_METRICS_PORT = metrics_endpoint.DEFAULT_PORT


def _metrics_port(text: str) -> int | None:
    try:
        return metrics_endpoint.parse_metrics_port(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"expected 0-65535 or 'off', got {text!r}") from exc


def _run_local(args: argparse.Namespace, trainer_args: list[str]) -> int:
    # Imported here so that `elastic-train --help` stays instant.
    from elastic_train.local.board import open_board
    from elastic_train.local.chaos import parse_schedule
    from elastic_train.local.cluster import ClusterSpec
    from elastic_train.local.runner import effective_config_toml, run_local

    spec = ClusterSpec(
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        min_nodes=args.min_nodes,
        max_nodes=args.max_nodes,
        chaos=parse_schedule(args.chaos),
        script_args=tuple(trainer_args),
        **({"script": _script_path(args.script)} if args.script else {}),
        rdzv_backend=args.rdzv_backend,
        rdzv_conf=args.rdzv_conf,
        metrics_port=args.metrics_port,
        timeout_s=args.timeout,
        finish_grace_s=args.finish_grace,
    )
    if args.print_config:
        print(effective_config_toml(spec, run_dir=args.run_dir), end="")
        return EXIT_OK
    with open_board(quiet=args.quiet) as progress:
        summary = run_local(
            spec,
            run_dir=args.run_dir,
            progress=progress,
            json_path=args.json,
            timeline=args.timeline,
        )
    doc = summary.to_json()
    brief = {k: doc[k] for k in ("completed", "final_step", "final_loss", "exactly_once")}
    print(json.dumps({**brief, "recoveries": doc["recoveries"], "run_dir": doc["run_dir"]}))
    if summary.timeline:
        print(f"timeline: {summary.timeline}", file=sys.stderr)  # stdout stays one JSON line
    if summary.error:
        print(f"error: {summary.error}", file=sys.stderr)
    return EXIT_OK if summary.completed and summary.exactly_once else EXIT_FAILED


def _script_path(path: str) -> str:
    """``--script``: an existing Python file, made absolute (the agents may run elsewhere)."""
    script = Path(path).resolve()
    if not script.is_file():
        raise ConfigError(f"--script {path!r}: no such file; expected a Python training script")
    return str(script)


def _add_export(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "export",
        help="write a checkpoint's model weights as model.safetensors and model.pt",
        description=textwrap.fill(
            "Write the model weights of SOURCE into OUT_DIR as model.safetensors and "
            "model.pt (a plain state dict for torch.load), each atomically. SOURCE is a "
            "checkpoint directory (its newest complete step), one step-N directory, "
            "whichever state file the run wrote into it (state.pt, or the node agent's "
            "state.slot), or any file checkpoint.init_from accepts. Our checkpoints are "
            "verified against their manifest before anything is unpickled."
        ),
    )
    p.add_argument("source", metavar="SOURCE", help="a checkpoint or weights to read")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (made if absent)")
    p.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace, extra: list[str]) -> int:
    from elastic_train.state.weights import complete_steps, export_weights, read_weights

    source = Path(args.source).expanduser()
    if steps := complete_steps(source):  # a checkpoint directory: say which step it was
        source = steps[0][1]
    weights = read_weights(str(source), key="SOURCE")
    written = export_weights(weights, args.out_dir, key="OUT_DIR")
    print(json.dumps({
        "source": str(source), "tensors": len(weights),
        "elements": sum(t.numel() for t in weights.values()), "files": [str(p) for p in written],
    }))  # fmt: skip
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-train", description="Elastic, fault-tolerant PyTorch training."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    _add_log_format(subparsers)
    return parser


def package_version() -> str:
    """The installed distribution's version (the one pip reports)."""
    try:
        return metadata.version("elastic-train")
    except metadata.PackageNotFoundError:
        return "unknown (not installed as a distribution)"


def _add_log_format(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``--log-format`` on every command that runs (``local``, ``spawn``, ``rdzv reset``)."""
    for parser in subparsers.choices.values():
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            _add_log_format(nested[0])
            continue
        parser.add_argument(
            "--log-format",
            choices=LOG_FORMATS,
            default="auto",
            help="this command's own log lines on stderr: auto (console on a terminal, "
            "JSON lines otherwise), json or console (default auto)",
        )


#: one ``add_*(subparsers)`` per subcommand; each sets ``handler(args, extra) -> int``
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [  # type: ignore[type-arg]
    _add_local,
    add_spawn_subcommand,
    add_rdzv_subcommand,
    _add_export,
]


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Unwinds through the runner's cleanup, like Ctrl-C does.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    configure_logging(json=json_for_format(args.log_format))
    if extra and args.command not in ("local", "spawn"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return int(args.handler(args, extra))
    except ConfigError as exc:
        print(f"elastic-train {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ElasticTrainError as exc:
        print(f"elastic-train {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("elastic-train: interrupted; everything it started is stopped", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
