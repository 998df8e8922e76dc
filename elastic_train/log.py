"""Structured logging: structlog configured once per process.

JSON lines by default; human-readable console output (structlog's
``ConsoleRenderer``) when stderr is a terminal. A command line chooses with
``--log-format auto|json|console`` (:data:`LOG_FORMATS`, :func:`json_for_format`):
``main.py`` takes it as the ``logging.format`` config key, the ``elastic-train``
commands as a flag of their own. Context that holds for a whole process is bound once with
:func:`bind_context`, not repeated at each call. The keys used across the
project: ``run_id``, ``node``, ``rank``, ``local_rank``, ``world_size``,
``restart`` (the torchrun restart count), and ``step`` on events about a step.

Events are named in snake case (``rendezvous_joined``, ``resumed``,
``checkpoint_saved``, ``checkpoint_fallback``, ``worker_hang_detected``) and carry their
facts as keys: ``log.info("checkpoint_saved", step=120, seconds=0.4)``.

The standard library's logging (torch's included) and ``warnings`` go through
the same pipeline. Every event, whatever its source, passes
:func:`redact_secrets` last before rendering: values under secret-looking keys,
``password=...``-style text, URL credentials, bearer tokens and every secret
registered with :func:`register_secret` (the etcd password and the rendezvous
signing secret are registered from the environment) are replaced.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import structlog

__all__ = [
    "LOG_FORMATS",
    "REDACTED",
    "bind_context",
    "clear_context",
    "configure_logging",
    "configure_logging_if_unconfigured",
    "get_logger",
    "json_for_format",
    "merge_process_context",
    "redact_secrets",
    "register_secret",
    "thread_context",
]

REDACTED = "[REDACTED]"
#: "auto": console on a terminal, JSON lines otherwise; "json" and "console" force one.
LOG_FORMATS = ("auto", "json", "console")
#: Environment variables that hold secrets (see the rendezvous' ``--rdzv-conf`` docs).
SECRET_ENV_VARS = ("ETCD_PASSWORD", "ELASTIC_TRAIN_RDZV_SECRET")
# Shorter registered secrets would blank out ordinary words of every message.
_MIN_SECRET_LENGTH = 4

_SECRET_WORD = r"pass(?:word|wd|phrase)?|secret|token|api[_-]?key|private[_-]?key|credentials?"
# Whole words of a key: auth_token and ETCD_PASSWORD are secrets, tokens_per_second is not.
_SECRET_KEY = re.compile(rf"(?i)(?:^|[_.-])(?:{_SECRET_WORD}|authorization|cookie)(?:$|[_.-])")
_SECRET_IN_TEXT = (
    # password=hunter2, "token": "abc", secret: 'x y', ETCD_PASSWORD=..., --password hunter2
    re.compile(
        rf"""(?ix)(\b(?:\w+[_-])?(?:{_SECRET_WORD})\b["']?\s*[=:]\s*|--(?:{_SECRET_WORD})\s+)
        ("[^"]*"|'[^']*'|[^\s,;&)}}\]]+)"""
    ),
    re.compile(r"(?i)(\bbearer\s+)([\w.~+/=-]+)"),
    re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)([^@\s/]+)(?=@)"),  # scheme://user:pw@
)
_secrets: set[str] = set()
_process_context: dict[str, Any] = {}


def register_secret(value: str | None) -> None:
    """Redact ``value`` wherever it appears in any later log event of this process."""
    if value and len(value) >= _MIN_SECRET_LENGTH:
        _secrets.add(value)


def _redact_text(text: str) -> str:
    for secret in sorted(_secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    for pattern in _SECRET_IN_TEXT:
        text = pattern.sub(lambda m: m.group(1) + REDACTED, text)
    return text


def _redact(value: Any) -> Any:
    if isinstance(value, str):
        return _redact_text(value)
    if isinstance(value, Mapping):
        return {key: _redact_item(key, item) for key, item in value.items()}
    if isinstance(value, list | tuple | set):
        return [_redact(item) for item in value]
    return value


def _redact_item(key: Any, value: Any) -> Any:
    return REDACTED if isinstance(key, str) and _SECRET_KEY.search(key) else _redact(value)


def redact_secrets(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: remove secrets from keys, nested values and message text."""
    return {
        # Keys with a leading underscore are structlog's own (the stdlib record).
        key: value if key.startswith("_") else _redact_item(key, value)
        for key, value in event_dict.items()
    }


def _route_torch_logging() -> None:
    """torch gives its loggers their own stderr handler and stops propagation: undo that."""
    for name, logger in logging.root.manager.loggerDict.items():
        if name.split(".")[0] == "torch" and isinstance(logger, logging.Logger):
            logger.handlers.clear()
            logger.propagate = True


def json_for_format(log_format: str) -> bool | None:
    """The ``json`` argument of :func:`configure_logging` for one of :data:`LOG_FORMATS`."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: expected one of {', '.join(LOG_FORMATS)}")
    return None if log_format == "auto" else log_format == "json"


def configure_logging(*, level: str = "INFO", json: bool | None = None) -> None:
    """Configure structlog and route stdlib logging (torch's too) and warnings through it.

    ``json=None`` renders JSON lines unless stderr is a terminal. Call it after
    importing torch: torch resets its loggers when imported.
    """
    for name in SECRET_ENV_VARS:
        register_secret(os.environ.get(name))
    use_json = (not sys.stderr.isatty()) if json is None else json
    renderer: Any = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        merge_process_context,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        # Tracebacks become text before redaction: an exception message can hold a secret.
        structlog.processors.format_exc_info,
        redact_secrets,
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=shared,
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    _route_torch_logging()
    logging.captureWarnings(True)


def configure_logging_if_unconfigured() -> None:
    """Configure with the defaults unless this process set up logging already.

    For code that runs inside someone else's process (the torchrun agent), where
    the host may have chosen its own logging (a test runner, an application).
    """
    if not logging.getLogger().handlers:
        configure_logging()


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)


def bind_context(**context: Any) -> None:
    """Bind context (run_id, node, rank, ...) to every later event of this process.

    Process-wide, not a context variable: events from threads started earlier or
    later (the checkpoint writer, the watchdog) carry it too.
    """
    _process_context.update(context)


def thread_context(**context: Any) -> contextlib.AbstractContextManager[Any]:
    """Bind ``context`` to the events of this thread inside the ``with`` block only
    (the node agent's persister: the world size of the state it writes)."""
    return structlog.contextvars.bound_contextvars(**context)


def clear_context() -> None:
    _process_context.clear()


def merge_process_context(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: add the :func:`bind_context` keys; an event's own keys win."""
    return {**_process_context, **event_dict}


_exit_now_hooks: list[Callable[[int], None]] = []


def on_exit_now(hook: Callable[[int], None]) -> None:
    """Call ``hook(code)`` in :func:`exit_now`, which skips ``atexit``."""
    _exit_now_hooks.append(hook)


def exit_now(code: int) -> NoReturn:
    """Exit with ``code`` without the interpreter's finalization.

    A worker's exit is on the recovery path: the agent restarts the group only
    once every worker is gone. Finalizing the interpreter after torch and gloo
    (module teardown, C++ destructors) took about 0.8 s here; everything that
    must outlive the process (checkpoints, audit records, snapshots, torchrun's
    error file) is already closed by then, so only the log streams need a flush
    (and the hooks of :func:`on_exit_now` run, as ``atexit`` hooks would).
    """
    for hook in _exit_now_hooks:
        with contextlib.suppress(Exception):
            hook(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
