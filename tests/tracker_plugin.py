"""A tracker plugged in by import string (``logging.trackers``), for the tracking tests:
it appends each ``(step, metrics)`` it receives to a JSON-lines file."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from elastic_train.config.job import JobConfig


class JsonLinesTracker:
    def __init__(self, path: Path) -> None:
        self.file = path.open("a")

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def json_lines(cfg: JobConfig) -> JsonLinesTracker:
    """Writes ``tracked.jsonl`` next to the TensorBoard files."""
    return JsonLinesTracker(Path(cfg.logging.tensorboard_dir) / "tracked.jsonl")
