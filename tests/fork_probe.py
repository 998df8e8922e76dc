"""What a process forked by ``elastic_train.local.agent_forks`` finds itself to be.

Run as ``__main__`` in the fork (tests/test_agent_forks.py): it prints one JSON
line (argv, environment, working directory, session, stdin, what was imported
before it) to its stdout, the log file, then acts on ``argv[1]``: ``exit:N``
exits with N, ``kill`` SIGKILLs itself, ``wait`` blocks until stdin... never
(``/dev/null``), so until a signal.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

if __name__ == "__main__":
    stdin = os.fstat(0)
    print(json.dumps({
        "argv": sys.argv,
        "probe": os.environ.get("FORK_PROBE"),
        "cwd": os.getcwd(),
        "pid": os.getpid(),
        "session_leader": os.getsid(0) == os.getpid(),
        "stdin_is_devnull": (stdin.st_dev, stdin.st_ino) == (os.stat(os.devnull).st_dev,
                                                             os.stat(os.devnull).st_ino),
        "torch_imported": "torch" in sys.modules,
        "threads": threading.active_count(),
        "name": Path(f"/proc/{os.getpid()}/comm").read_text().strip(),
    }), flush=True)  # fmt: skip
    action = sys.argv[1]
    if action.startswith("exit:"):
        sys.exit(int(action.split(":")[1]))
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Event().wait()
