"""Structured logs: bound context on real events, secrets never in a real log output."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from elastic_train.log import (
    REDACTED,
    bind_context,
    clear_context,
    merge_process_context,
    redact_secrets,
    register_secret,
)
from elastic_train.state.checkpoint import CheckpointManager

CONTEXT = {
    "run_id": "run-7",
    "node": "node3",
    "rank": 2,
    "local_rank": 0,
    "world_size": 4,
    "restart": 1,
}
PROCESSORS = [merge_process_context, redact_secrets]


@pytest.fixture
def bound_context() -> Iterator[dict]:
    bind_context(**CONTEXT)
    yield CONTEXT
    clear_context()


def test_checkpoint_events_carry_the_bound_context(tmp_path: Path, bound_context: dict) -> None:
    manager = CheckpointManager(tmp_path, keep=2, fingerprint="fp", is_writer=True)
    with capture_logs(processors=PROCESSORS) as logs:
        manager.save(5, {"w": torch.ones(3), "step": 5}, blocking=True)
        manager.save(6, {"w": torch.ones(3), "step": 6})  # logged by the writer thread
        manager.flush()
        (tmp_path / "step-000000006" / "state.pt").write_bytes(b"torn")
        assert manager.load_latest(map_location="cpu")[0] == 5
    saved = [entry for entry in logs if entry["event"] == "checkpoint_saved"]
    fallback = [entry for entry in logs if entry["event"] == "checkpoint_fallback"]
    assert [entry["step"] for entry in saved] == [5, 6]
    assert [entry["step"] for entry in fallback] == [6]
    for entry in saved + fallback:
        assert {key: entry[key] for key in bound_context} == bound_context


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("connect with password=hunter2 to etcd", "hunter2"),
        ('{"token": "abc123def", "endpoint": "x"}', "abc123def"),
        ("ETCD_PASSWORD=pa55word ./run", "pa55word"),
        ("etcdctl --password s3cr3tpw get /", "s3cr3tpw"),
        ("https://root:rootpw99@10.0.0.1:2379/v3", "rootpw99"),
        ("Authorization: Bearer eyJhbGciOi.payload", "eyJhbGciOi.payload"),
    ],
)
def test_secret_patterns_in_text_are_redacted(text: str, secret: str) -> None:
    out = redact_secrets(None, "info", {"event": text})["event"]
    assert secret not in out and REDACTED in out


def test_secret_keys_are_redacted_at_any_depth_and_others_are_kept() -> None:
    event = {
        "event": "config",
        "etcd": {"password": "p1", "endpoints": ["a:2379"], "auth_token": "t1"},
        "tokens_per_second": 12.5,
        "key_prefix": "/elastic",
    }
    out = redact_secrets(None, "info", event)
    assert out["etcd"] == {"password": REDACTED, "endpoints": ["a:2379"], "auth_token": REDACTED}
    assert out["tokens_per_second"] == 12.5 and out["key_prefix"] == "/elastic"


def test_registered_secret_is_redacted_anywhere() -> None:
    register_secret("correct-horse-battery")
    out = redact_secrets(None, "info", {"event": "auth failed: correct-horse-battery", "x": 1})
    assert out["event"] == f"auth failed: {REDACTED}"


_CHILD = textwrap.dedent(
    """
    import logging, sys, warnings
    import torch
    from elastic_train.log import bind_context, configure_logging, get_logger

    configure_logging(json=True)
    bind_context(run_id="r1", node="node0", rank=0)
    secret = sys.argv[1]
    log = get_logger("child")
    log.info("etcd_connect", password=secret, endpoint="127.0.0.1:2379")
    log.info("etcd_config", config={"etcd": {"password": secret, "username": "root"}})
    log.warning(f"login refused for root:{secret}")
    logging.getLogger("torch.distributed.elastic.agent").warning("auth %s failed", secret)
    warnings.warn(f"retrying with {secret}")
    try:
        raise RuntimeError(f"etcd said: invalid password {secret}")
    except RuntimeError:
        log.exception("etcd_failed")
    """
)


def test_no_secret_in_a_real_log_output() -> None:
    """A process logs the etcd password every way it could leak; none reaches stderr."""
    secret = "Zq8-never-log-me"
    env = {**os.environ, "ETCD_PASSWORD": secret}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, secret],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert secret not in proc.stderr + proc.stdout
    lines = [json.loads(line) for line in proc.stderr.splitlines()]
    by_event = {line["event"].split(" ")[0]: line for line in lines}
    assert by_event["etcd_connect"]["password"] == REDACTED
    assert by_event["etcd_connect"]["run_id"] == "r1"
    assert by_event["etcd_config"]["config"]["etcd"]["username"] == "root"
    assert "etcd_failed" in by_event and REDACTED in by_event["etcd_failed"]["exception"]
    # torch's loggers and warnings are routed through the same JSON pipeline
    torch_line = next(line for line in lines if line["logger"].startswith("torch."))
    assert torch_line["event"] == f"auth {REDACTED} failed"
    assert torch_line["node"] == "node0"
    assert any(line["logger"] == "py.warnings" for line in lines)


def test_console_output_on_a_terminal_and_json_otherwise() -> None:
    child = (
        "from elastic_train.log import configure_logging, get_logger\n"
        "configure_logging()\n"
        "get_logger('t').info('hello_event', answer=42)\n"
    )
    piped = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(piped.stderr)["event"] == "hello_event"

    leader, follower = pty.openpty()
    with subprocess.Popen([sys.executable, "-c", child], stderr=follower) as proc:
        os.close(follower)
        output = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not chunk:
                break
            output += chunk
    os.close(leader)
    assert proc.returncode == 0
    text = output.decode()
    assert "hello_event" in text and "answer" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
