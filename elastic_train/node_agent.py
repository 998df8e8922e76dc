"""Code that runs inside the long-lived torchrun agent process.

The rendezvous handler creator calls :func:`wrap_handler` once per agent, which
is where node-level services (the metrics endpoint) start.
"""

from __future__ import annotations

from typing import Any


def wrap_handler(handler: Any, params: Any) -> Any:
    """Hook for agent-side services; returns the handler to give torchrun."""
    return handler
