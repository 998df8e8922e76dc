"""``main.py``'s command line: ``--config PATH``, ``--print-config``, ``--help``, ``--log-format``
and overrides."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args, get_type_hints

from elastic_train.config.describe import describe_config
from elastic_train.config.job import JobConfig, LoggingConfig
from elastic_train.config.load import load_config
from elastic_train.errors import ConfigError

# -- command line -------------------------------------------------------------

USAGE = """\
usage: python -m elastic_train.main [-h] [--config PATH] [--print-config]
                                   [--log-format auto|json|console] [--SECTION.KEY=VALUE ...]
   or: python elastic_train/main.py [same arguments]
   or: torchrun [TORCHRUN OPTIONS] -m elastic_train.main [same arguments]
   or: torchrun [TORCHRUN OPTIONS] elastic_train/main.py [same arguments]

  --config PATH          TOML file with [section] tables (see docs/training.md)
  --print-config         print the effective configuration as TOML and exit
  --log-format FORMAT    auto (console on a terminal, JSON lines otherwise), json or
                         console; the same as --logging.format=FORMAT
  -h, --help             print this help, with every config key below, and exit
  --SECTION.KEY=VALUE    override one field, e.g. --training.steps=100
  --local-rank N         accepted and ignored: LOCAL_RANK comes from the environment
"""

_LEGACY_LOCAL_RANK = ("--local_rank", "--local-rank")
#: ``--log-format`` is a shorthand of this config key
_LOG_FORMAT_KEY = "logging.format"


@dataclass(frozen=True)
class CliArgs:
    config: JobConfig
    print_config: bool = False
    help: bool = False


@dataclass
class _Scanned:
    """The command line taken apart, before any file is read."""

    path: str | None = None
    overrides: list[str] = field(default_factory=list)
    print_config: bool = False
    help: bool = False


def help_text() -> str:
    """``--help``: the usage, then every config key (:func:`describe.describe_config`)."""
    return f"{USAGE}\n{describe_config()}"


def help_requested(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks for ``--help``; reads no file, so it can run before torch loads.

    A malformed command line is not a request for help: :func:`parse_cli`
    then reports what is wrong with it.
    """
    try:
        return _scan(argv).help
    except ConfigError:
        return False


def parse_cli(argv: Sequence[str], *, base: Mapping[str, Any] | None = None) -> CliArgs:
    """Parse ``main.py``'s arguments (over ``base``, see :func:`load.load_config`);
    raises :class:`ConfigError` naming the bad one."""
    scanned = _scan(argv)
    if scanned.help:
        return CliArgs(config=JobConfig(), help=True)
    config = load_config(scanned.path, scanned.overrides, base=base)
    return CliArgs(config=config, print_config=scanned.print_config)


def _scan(argv: Sequence[str]) -> _Scanned:
    scanned = _Scanned()
    args = list(argv)
    while args:
        arg = args.pop(0)
        name, has_value, value = arg.partition("=")
        if arg in ("-h", "--help"):
            scanned.help = True
        elif arg == "--print-config":
            scanned.print_config = True
        elif name in ("--config", "--log-format", *_LEGACY_LOCAL_RANK):
            if not has_value:
                if not args:
                    raise ConfigError(f"{name} needs a value")
                value = args.pop(0)
            if name == "--config":
                scanned.path = value
            elif name == "--log-format":
                scanned.overrides.append(f"{_LOG_FORMAT_KEY}={_log_format(value)}")
        elif arg.startswith("--") and "." in name:
            if not has_value:
                if not args:
                    raise ConfigError(f"{name} needs a value")
                value = args.pop(0)
            scanned.overrides.append(f"{name[2:]}={value}")
        else:
            raise ConfigError(f"unknown argument {arg!r}; expected --SECTION.KEY=VALUE\n{USAGE}")
    return scanned


def _log_format(value: str) -> str:
    choices = get_args(get_type_hints(LoggingConfig)["format"])
    if value not in choices:
        raise ConfigError(f"--log-format {value!r}: expected one of {', '.join(choices)}")
    return value
