"""``main.py``'s command line: ``--config PATH``, ``--print-config`` and overrides."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elastic_train.config.job import JobConfig
from elastic_train.config.load import load_config
from elastic_train.errors import ConfigError

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
