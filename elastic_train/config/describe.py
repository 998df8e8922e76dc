"""Every config key with its type, default and help, read off the dataclasses of ``job.py``.

``main.py --help`` prints :func:`describe_config`, and so does ``elastic-train
local --help`` (as its argparse epilog); :func:`config_keys` gives the same in a
structured form. Nothing here is written by hand per key: the sections and
keys come from :data:`~elastic_train.config.job.SECTIONS`, the types from the
annotations, the defaults from :func:`~elastic_train.config.load.to_toml` of a
default :class:`~elastic_train.config.job.JobConfig` (so they read exactly as
``--print-config`` writes them), and the help from the ``#:`` comment block above
each field in ``job.py`` (or its trailing ``# ...`` comment). Adding a field
therefore adds it to the help, and ``tests/test_help_config.py`` fails for a
field without a comment (``tests/test_cli_newcomer.py`` checks ``local --help``).

Only the standard library and ``config`` are imported: ``--help`` never
imports torch.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from elastic_train.config import job
from elastic_train.config.job import SECTIONS, JobConfig
from elastic_train.config.load import to_toml

#: Trailing comments that are tool directives, not help.
_DIRECTIVES = re.compile(r"^(fmt:|type:|noqa|pragma:)")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
#: A first sentence shorter than this ("Process-group timeout.") takes the next one along.
_SHORT = 40


@dataclass(frozen=True)
class ConfigKey:
    """One key of the job configuration, as ``--help`` shows it."""

    section: str
    key: str
    #: ``int``, ``float``, ``bool``, ``str``, ``table``, or the choices ``"a" | "b"``
    type: str
    #: the default as a TOML value, as ``--print-config`` writes it
    default: str
    #: one line: the first sentence of the field's comment (and one per choice)
    help: str
    #: the whole comment above (or after) the field
    comment: str

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"


def config_keys() -> list[ConfigKey]:
    """Every key of every section of :class:`JobConfig`, in declaration order."""
    comments = field_comments()
    defaults = _toml_defaults()
    keys = []
    for section, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            comment = comments.get((cls.__name__, f.name), "")
            keys.append(
                ConfigKey(
                    section=section,
                    key=f.name,
                    type=type_name(hints[f.name]),
                    default=defaults[section][f.name],
                    help=one_line(comment, choices=_choices(hints[f.name])),
                    comment=comment,
                )
            )
    return keys


def describe_config(*, width: int = 100) -> str:
    """The keys grouped by ``[section]``: ``key: type = default`` and an indented help line."""
    lines = [
        "Configuration keys (set them in the --config TOML file under [section],",
        "or override one with --SECTION.KEY=VALUE; a table takes --SECTION.KEY.NAME=VALUE):",
    ]
    section = ""
    for item in config_keys():
        if item.section != section:
            section = item.section
            lines += ["", f"[{section}]"]
        lines.append(f"  {item.key}: {item.type} = {item.default}")
        lines += textwrap.wrap(
            item.help or "(no help)", width=width, initial_indent=" " * 6, subsequent_indent=" " * 6
        )
    return "\n".join(lines) + "\n"


def type_name(annotation: Any) -> str:
    """``int``, ``table`` for a dict, the choices ``"a" | "b"`` of a ``Literal``."""
    if get_origin(annotation) is Literal:
        return " | ".join(f'"{choice}"' for choice in get_args(annotation))
    if get_origin(annotation) is dict:
        return "table"
    # A plain class by name ("int"); a generic as written ("list[str]", not "list").
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def one_line(comment: str, *, choices: tuple[str, ...] = ()) -> str:
    """The first sentence (two if it is short), plus each sentence explaining one of ``choices``.

    ``job.py``'s comments often go on with the reasons behind a default (the
    measurements, the trade-off): worth reading in the source, too long for ``--help``.
    """
    text = re.sub(r"``(.*?)``", r"\1", " ".join(comment.split()))
    if not text:
        return ""
    first, *rest = _SENTENCE_END.split(text)
    if len(first) < _SHORT and rest:
        first = f"{first} {rest.pop(0)}"
    explained = [s for s in rest if any(s.startswith(f'"{c}"') for c in choices)]
    return " ".join([first, *explained])


def _choices(annotation: Any) -> tuple[str, ...]:
    if get_origin(annotation) is Literal:
        return tuple(str(choice) for choice in get_args(annotation))
    return ()


def _toml_defaults() -> dict[str, dict[str, str]]:
    """``{section: {key: TOML value}}`` of a default :class:`JobConfig`."""
    defaults: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in to_toml(JobConfig()).splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = defaults.setdefault(line[1:-1], {})
        elif line:
            key, _, value = line.partition(" = ")
            current[key] = value
    return defaults


@cache
def field_comments() -> dict[tuple[str, str], str]:
    """``{(class name, field): comment}`` of the dataclasses in ``job.py``."""
    return comments_in(Path(job.__file__).read_text(encoding="utf-8"))


def comments_in(source: str) -> dict[tuple[str, str], str]:
    """``{(class name, field): comment}`` for the annotated fields of the classes in ``source``.

    The comment is the block of ``#:`` lines right above the field, else the
    ``# ...`` comment at the end of its line; fields with neither are absent.
    """
    lines = source.splitlines()
    trailing = _trailing_comments(source)
    found: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above = _comment_block_above(lines, stmt.lineno)
            text = above or trailing.get(stmt.end_lineno or stmt.lineno, "")
            if text:
                found[(node.name, stmt.target.id)] = text
    return found


def _comment_block_above(lines: list[str], lineno: int) -> str:
    block: list[str] = []
    index = lineno - 2  # the line above, 0-based
    while index >= 0 and lines[index].strip().startswith("#:"):
        block.insert(0, lines[index].strip()[2:].strip())
        index -= 1
    return " ".join(block)


def _trailing_comments(source: str) -> dict[int, str]:
    """``{line: comment}`` of comments after code (tokenized: a ``#`` in a string is none)."""
    found: dict[int, str] = {}
    previous_line = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and token.start[0] == previous_line:
            text = token.string.lstrip("#").strip()
            if not _DIRECTIVES.match(text):
                found[token.start[0]] = text
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            previous_line = token.end[0]
    return found
