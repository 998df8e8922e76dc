"""A worker's words to its torchrun agent: that a restart cannot help, and that
its process group has formed.

torchrun restarts failed workers up to ``--max-restarts`` times, whatever
they died of. A configuration error found only once the worker builds (a
model that needs a dataset's vocabulary, a checkpoint of another model) fails
every restart the same way: under ``elastic-train local`` (1000 restarts) the
run looped for its whole timeout, a restart a second, the error buried in the
log. So the node agent exports :data:`CONFIG_ERROR_FILE_ENV`, a path in a
directory of its own; a worker that exits with ``EXIT_CONFIG_ERROR`` writes its
message there first (:func:`report_config_error`); and before any restart's
round the agent reads it (:func:`read_config_error`) and exits with the same
code instead of restarting.

Without the variable (a plain ``torchrun`` of another launcher, ``spawn``)
nothing is written and nothing changes. A file that cannot be written costs
only the old behaviour (the restarts).

The second word, in the same directory: at each rendezvous round the agent
exports :data:`GROUP_FORMED_FILE_ENV`, the round's own path there
(:func:`group_formed_file`), and a worker creates that file once it has built
its training wrapper in the round's process group
(:func:`report_group_formed`). Until then the agent's round settles
(``elastic_train/rendezvous/settling.py``): a peer node that dies meanwhile
ends the round, instead of leaving the workers waiting for it at their store.
A file that cannot be written costs only that, up to the settling limit.

The directory is named after the agent's pid (:func:`config_error_file`). An
agent removes its own at exit; one that was SIGKILLed cannot, so each new
agent first removes the directories of agents that are gone: their
group-formed files (which say nothing once their agent is gone), then the
directory if it is empty. ``rmdir`` fails on a directory that holds a
report, so none is lost. (Agents in different pid namespaces that share one
``/tmp`` may take each other's for gone; that costs the other agent the
report, i.e. the restarts, or a round's settling until its limit.)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import psutil

from elastic_train.log import get_logger

__all__ = [
    "CONFIG_ERROR_FILE_ENV",
    "GROUP_FORMED_FILE_ENV",
    "config_error_file",
    "group_formed_file",
    "read_config_error",
    "remove_stale_directories",
    "report_config_error",
    "report_group_formed",
]

log = get_logger(__name__)

#: the file a worker writes its configuration error to, set by the node agent
CONFIG_ERROR_FILE_ENV = "ELASTIC_TRAIN_CONFIG_ERROR_FILE"
#: the file a worker creates once its process group formed, set by the agent per round
GROUP_FORMED_FILE_ENV = "ELASTIC_TRAIN_GROUP_FORMED_FILE"
_FORMED_PREFIX = "group-formed-"
#: at most this much of a message is kept
_MAX_CHARS = 4000
#: ``<prefix><agent pid>-<random>``
_PREFIX = "elastic_train-agent-"


def config_error_file(parent: Path | None = None) -> Path:
    """The path a worker of this agent reports its configuration error at, in a new
    0700 directory of this process's (removed at exit) under ``parent`` (default:
    the temp directory); first removes what SIGKILLed agents left there."""
    parent = Path(parent or tempfile.gettempdir())
    remove_stale_directories(parent)
    directory = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=parent))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory / "config_error"


def remove_stale_directories(parent: Path) -> None:
    """Remove the directories under ``parent`` of agents whose process is gone, unless
    they hold a configuration error (the rounds' group-formed files say nothing then)."""
    for directory in parent.glob(f"{_PREFIX}*-*"):
        pid = directory.name[len(_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or psutil.pid_exists(int(pid)):
            continue
        with contextlib.suppress(OSError):  # not ours, or removed meanwhile
            for formed in directory.glob(f"{_FORMED_PREFIX}*"):
                formed.unlink()
        with contextlib.suppress(OSError):  # not empty, not ours, or removed meanwhile
            directory.rmdir()


def group_formed_file(directory: Path, round_: int) -> Path:
    """The file of ``round_`` that the agent's workers create once their group formed,
    in the agent's directory (the one :func:`config_error_file` made)."""
    return directory / f"{_FORMED_PREFIX}{round_}"


def report_group_formed(environ: Mapping[str, str] = os.environ) -> None:
    """Tell this worker's agent, if it listens, that the round's process group formed."""
    path = environ.get(GROUP_FORMED_FILE_ENV)
    if not path:
        return
    try:
        Path(path).touch()
    except OSError as exc:  # the agent's round settles until its limit
        log.warning("group_formed_not_reported", path=path, error=str(exc))


def report_config_error(message: str, environ: Mapping[str, str] = os.environ) -> None:
    """Tell this worker's agent, if it listens, that ``message`` ended the worker."""
    path = environ.get(CONFIG_ERROR_FILE_ENV)
    if not path:
        return
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        partial.write_text(message[:_MAX_CHARS])
        os.replace(partial, target)  # the agent never reads half a message
    except OSError as exc:
        log.warning("config_error_not_reported", path=path, error=str(exc))
        with contextlib.suppress(OSError):
            partial.unlink()


def read_config_error(path: Path) -> str | None:
    """The message a worker reported at ``path``, or None."""
    try:
        return path.read_text()
    except OSError:  # none reported (or unreadable: the restarts go on, as before)
        return None
