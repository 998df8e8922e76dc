"""A worker's configuration error, told to its agent through a file (agent/verdict.py)."""

from __future__ import annotations

from pathlib import Path

from elastic_train.agent.verdict import (
    CONFIG_ERROR_FILE_ENV,
    read_config_error,
    report_config_error,
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
