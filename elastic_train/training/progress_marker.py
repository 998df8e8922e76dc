"""A step number that rank 0 overwrites in place: the loop's last completed
step (``progress.json``) and the tracking watermark (``tracking.json``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

#: In the checkpoint directory: the last completed step (see ProgressMarker).
PROGRESS_FILE = "progress.json"


class ProgressMarker:
    """The last completed step, which rank 0 overwrites in place after every step.

    A restart counts the steps it lost (work redone) as this minus the step of
    the checkpoint it restores. One fixed-width ``pwrite`` per step: a rename
    or fsync per step would cost milliseconds on network storage.
    """

    def __init__(self, directory: str, *, writer: bool, name: str = PROGRESS_FILE) -> None:
        self.path = Path(directory) / name if directory else None
        self.writer = writer and self.path is not None
        self._fd = -1

    def read(self) -> int:
        try:
            return int(json.loads(self.path.read_text())["step"]) if self.path else 0
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def record(self, step: int) -> None:
        if not self.writer:
            return
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)  # type: ignore[arg-type]
        # Fixed width, so each write covers the previous one; still valid JSON.
        os.pwrite(self._fd, f'{{"step": {step:20d}}}\n'.encode(), 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
