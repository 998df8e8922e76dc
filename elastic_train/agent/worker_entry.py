"""What torchrun runs in each worker, read off the torchrun command line.

The zygote (:mod:`elastic_train.agent.zygote`) imports torch once and forks
each worker from there; it must then run exactly what a cold start would:
the training script by path, or the module given with ``-m``. This module
finds that entry in the agent's own command line and runs it in a forked
child.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OUR_MAIN", "WorkerEntry"]

#: the trainer this package ships, by path and by module name
OUR_MAIN = Path(__file__).resolve().parent.parent / "main.py"
_OUR_MODULE = "elastic_train.main"


@dataclass(frozen=True)
class WorkerEntry:
    """A worker's entry: a script path (made absolute) or a module name (``-m``)."""

    target: str
    is_module: bool = False

    @classmethod
    def from_torchrun_argv(cls, argv: Sequence[str]) -> WorkerEntry | None:
        """The entry of a ``torchrun`` (or ``python -m torch.distributed.run``) command line.

        None when ``argv`` is not such a command, or runs a non-Python
        program (``--no-python``): nothing a Python zygote could start.
        """
        program = Path(argv[0]).as_posix() if argv else ""
        if not (Path(program).name == "torchrun" or program.endswith("torch/distributed/run.py")):
            return None
        from torch.distributed.run import get_args_parser  # the agent has imported it already

        try:
            args = get_args_parser().parse_args(list(argv[1:]))
        except SystemExit:
            return None
        if args.no_python or not args.training_script:
            return None
        if args.module:
            return cls(args.training_script, is_module=True)
        return cls(os.path.abspath(args.training_script))

    def is_ours(self) -> bool:
        """Whether this runs ``elastic_train/main.py`` (by path or ``-m elastic_train.main``)."""
        if self.is_module:
            return self.target == _OUR_MODULE
        return Path(self.target).resolve() == OUR_MAIN

    def file(self) -> str | None:
        """The real path of the file that runs as ``__main__``; None if it cannot be found."""
        if not self.is_module:
            return os.path.realpath(self.target)
        try:
            spec = importlib.util.find_spec(self.target)
        except (ImportError, ValueError):
            return None
        if spec is None or spec.origin is None:
            return None
        if spec.submodule_search_locations is not None:  # a package runs its __main__
            return os.path.realpath(os.path.join(os.path.dirname(spec.origin), "__main__.py"))
        return os.path.realpath(spec.origin)

    def run(self) -> int:
        """Run the entry as ``__main__`` in this process, as a cold start would; its exit code."""
        try:
            if self.is_module:
                runpy.run_module(self.target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(self.target, run_name="__main__")
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                return exc.code or 0
            print(exc.code, file=sys.stderr)
            return 1
        except BaseException:
            sys.excepthook(*sys.exc_info())
            return 1
        return 0
