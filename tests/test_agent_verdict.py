"""A worker's words to its agent through files (agent/verdict.py): a configuration
error, and that the round's process group formed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from elastic_train.agent.verdict import (
    CONFIG_ERROR_FILE_ENV,
    GROUP_FORMED_FILE_ENV,
    config_error_file,
    group_formed_file,
    read_config_error,
    remove_stale_directories,
    report_config_error,
    report_group_formed,
)


def test_the_message_reaches_the_file_the_agent_named(tmp_path: Path) -> None:
    target = tmp_path / "config_error"
    assert read_config_error(target) is None  # nothing reported: the agent restarts
    report_config_error("model.name = 'x': no such model", {CONFIG_ERROR_FILE_ENV: str(target)})
    assert read_config_error(target) == "model.name = 'x': no such model"
    assert [p.name for p in tmp_path.iterdir()] == ["config_error"]  # no partial left


def test_without_an_agent_listening_nothing_is_written(tmp_path: Path) -> None:
    report_config_error("anything", {"UNRELATED": str(tmp_path / "f")})
    assert not list(tmp_path.iterdir())


def test_an_unwritable_file_costs_only_the_report(tmp_path: Path) -> None:
    missing_dir = tmp_path / "gone" / "config_error"
    report_config_error("anything", {CONFIG_ERROR_FILE_ENV: str(missing_dir)})  # no raise
    assert read_config_error(missing_dir) is None


def test_an_agents_directory_is_named_after_it_and_removed_at_its_exit(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from elastic_train.agent.verdict import "
        "config_error_file; import os; print(os.getpid(), config_error_file(Path(sys.argv[1])))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, check=True)  # fmt: skip
    pid, path = done.stdout.split()
    reported = Path(path)
    assert reported.parent.parent == tmp_path and reported.name == "config_error"
    assert reported.parent.name.startswith(f"elastic_train-agent-{pid}-")
    assert not reported.parent.exists()  # its atexit removed it


def test_a_new_agent_removes_only_the_empty_directories_of_agents_that_are_gone(
    tmp_path: Path,
) -> None:
    # Real pids: one of a process that has exited, one of a process still running.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_empty = tmp_path / f"elastic_train-agent-{gone.pid}-abc"
        dead_reported = tmp_path / f"elastic_train-agent-{gone.pid}-def"
        dead_formed = tmp_path / f"elastic_train-agent-{gone.pid}-jkl"
        alive_empty = tmp_path / f"elastic_train-agent-{running.pid}-ghi"
        old_format = tmp_path / "elastic_train-agent-0a1b2c3d"  # before pids were in names
        for directory in (dead_empty, dead_reported, dead_formed, alive_empty, old_format):
            directory.mkdir()
        (dead_reported / "config_error").write_text("model.name = 'x': no such model")
        for round_ in (0, 3):  # the words of rounds long over say nothing any more
            report_group_formed(
                {GROUP_FORMED_FILE_ENV: str(group_formed_file(dead_formed, round_))}
            )
        report_group_formed({GROUP_FORMED_FILE_ENV: str(group_formed_file(dead_reported, 1))})
        assert len(list(dead_formed.iterdir())) == 2
        mine = config_error_file(tmp_path)
        assert not dead_empty.exists() and not dead_formed.exists()
        assert read_config_error(dead_reported / "config_error") == (
            "model.name = 'x': no such model"
        )  # a report is never removed
        assert alive_empty.exists() and old_format.exists()
        assert mine.parent.name.startswith(f"elastic_train-agent-{os.getpid()}-")
        assert mine.parent.stat().st_mode & 0o777 == 0o700
        remove_stale_directories(tmp_path)  # a live agent's own directory stays
        assert mine.parent.exists()
    finally:
        running.kill()
        running.wait()


def test_a_worker_says_its_group_formed_in_the_rounds_own_file(tmp_path: Path) -> None:
    first, second = group_formed_file(tmp_path, 1), group_formed_file(tmp_path, 2)
    assert first != second and first.parent == tmp_path
    report_group_formed({GROUP_FORMED_FILE_ENV: str(second)})
    assert second.exists() and not first.exists()
    report_group_formed({})  # no agent listens: nothing written, nothing raised
    report_group_formed({GROUP_FORMED_FILE_ENV: str(tmp_path / "gone" / "x")})  # unwritable
    assert sorted(p.name for p in tmp_path.iterdir()) == [second.name]
