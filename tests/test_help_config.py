"""``--help`` lists every config key, checked against the dataclasses of ``config/job.py``."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import pytest
import tomllib

from elastic_train.config import describe
from elastic_train.config.args import help_requested, help_text, parse_cli
from elastic_train.config.job import SECTIONS, JobConfig

REPO = Path(__file__).resolve().parents[1]
MAIN = REPO / "elastic_train" / "main.py"


def _sections(text: str) -> dict[str, dict[str, tuple[str, str]]]:
    """``[section]`` -> ``{key: (the "key: type = default" line, the help under it)}``."""
    found: dict[str, dict[str, tuple[str, str]]] = {}
    section, key = None, None
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            section, key = line[1:-1], None
            found[section] = {}
        elif section and line.startswith("  ") and not line.startswith("   "):
            key = line.strip().partition(":")[0]
            found[section][key] = (line.strip(), "")
        elif section and key and line.startswith("      "):
            head, help_ = found[section][key]
            found[section][key] = (head, f"{help_} {line.strip()}".strip())
    return found


def _expected_type(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return " | ".join(f'"{c}"' for c in get_args(annotation))
    if get_origin(annotation) is dict:
        return "table"
    return {int: "int", float: "float", bool: "bool", str: "str"}.get(annotation, str(annotation))


def test_every_field_of_every_section_is_listed_with_its_type_and_default() -> None:
    listed = _sections(describe.describe_config())
    defaults = JobConfig()
    assert list(listed) == list(SECTIONS)
    for section, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        assert list(listed[section]) == names, section
        for name in names:
            head, help_ = listed[section][name]
            typ, _, default = head.partition(": ")[2].partition(" = ")
            assert typ == _expected_type(hints[name]), f"{section}.{name}"
            # The default reads back, as TOML, to the dataclass's own default.
            value = tomllib.loads(f"v = {default}")["v"]
            assert value == getattr(getattr(defaults, section), name), f"{section}.{name}"
            assert help_ and help_ != "(no help)", f"{section}.{name} has no help"


def test_every_field_has_a_comment_in_job_py() -> None:
    """A new field without a ``#:`` comment fails here, so the help stays complete."""
    undocumented = [k.name for k in describe.config_keys() if not k.comment]
    assert not undocumented, f"add a #: comment above these fields in config/job.py: {undocumented}"


def test_comments_are_read_above_a_field_or_after_it_and_directives_are_not_help() -> None:
    source = """
@dataclass
class Example:
    SECTION: ClassVar[str] = "example"
    #: First line of the help,
    #: and its second line.
    documented: int = 1
    trailing: int = 2  # only "#" inside a string is no comment
    skipped: tuple[int, ...] = (1,
                                2)  # fmt: skip
    text: str = "# not a comment"
    # a plain comment above is an implementation note, not help
    plain: int = 3
"""
    assert describe.comments_in(source) == {
        ("Example", "documented"): "First line of the help, and its second line.",
        ("Example", "trailing"): 'only "#" inside a string is no comment',
    }


@pytest.mark.parametrize(
    ("comment", "choices", "expected"),
    [
        ("Save a checkpoint every this many steps; 0: off. Measured: 3 ms.", (),
         "Save a checkpoint every this many steps; 0: off."),
        ("Timeout. A hung peer waits that long. 60 s is plenty.", (),
         "Timeout. A hung peer waits that long."),
        ('"a": the first choice, described at some length. Why a. "b": the second.', ("a", "b"),
         '"a": the first choice, described at some length. "b": the second.'),
        ("Calls ``pkg.mod:fn`` to build it,\n   once per worker.", (),
         "Calls pkg.mod:fn to build it, once per worker."),
    ],
)  # fmt: skip
def test_one_line_is_the_first_sentence_and_one_per_choice(
    comment: str, choices: tuple[str, ...], expected: str
) -> None:
    """The reasons behind a default stay in the source; a short first sentence takes the next."""
    assert describe.one_line(comment, choices=choices) == expected


def test_help_is_recognised_without_reading_the_config_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.toml")
    assert help_requested(["--config", missing, "--training.steps=many", "--help"])
    assert parse_cli(["--config", missing, "-h"]).help
    assert not help_requested(["--bogus", "--help"])  # parse_cli names --bogus instead
    assert not help_requested(["--config", "--help"])  # the value of --config, not a flag


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))}


@pytest.mark.parametrize("form", ["module", "path"])
def test_main_help_exits_0_lists_the_keys_and_never_imports_torch(
    form: str, tmp_path: Path
) -> None:
    entry = ["-m", "elastic_train.main"] if form == "module" else [str(MAIN)]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *entry, "--help"],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == help_text()
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert "elastic_train.config.describe" in imported  # -X importtime did report
    assert not {m for m in imported if m.split(".")[0] == "torch"}
    heavy = ("elastic_train.training", "elastic_train.agent")
    assert not {m for m in imported if m.startswith(heavy)}
    assert list(tmp_path.iterdir()) == []  # no checkpoint or audit directory made
    assert elapsed < 30, elapsed  # seconds, not the ~10 s of importing torch on a loaded box


def test_a_worker_start_hands_over_before_importing_the_help(tmp_path: Path) -> None:
    """Without -h, main.py reaches the warm-start hand-over with only the standard library.

    Every worker start (and restart) goes through it, so the --help check must
    not add the config imports in front of it.
    """
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(MAIN), "--print-config"],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    order = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    config = [i for i, m in enumerate(order) if m.startswith("elastic_train.config")]
    assert order.index("elastic_train.agent.warm_start") < min(config)
