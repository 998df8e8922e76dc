"""Which recovery a worker runs: ``elastic.recovery = "auto"``, resolved once before any group.

``"auto"`` is in-process recovery (docs/recovery-inprocess.md) wherever it is
known to work, and the restart path everywhere else:

===========================  ===============================================
needs                        why
===========================  ===============================================
our torchrun plugin          the survivors agree on the next group in the
(:data:`ETCD_ENV` is set)    rendezvous' etcd; without torchrun, or with
                             another rendezvous, there is no etcd to ask
a rendezvous secret          every value in etcd is signed (or the
(or ``insecure=1``)          rendezvous runs insecure on purpose)
DDP, global batches          a step that does not depend on the world size
                             (the in-process path re-splits the same batch)
gloo                         NCCL's communicator abort has run on one GPU
                             (tests/test_cuda.py), but a peer's death inside
                             a multi-rank NCCL collective has not
torch >= 2.8                 older releases destroy a gloo group holding the
                             GIL; a gloo thread that frees a tensor then
                             waits for the GIL, and the survivor's re-form
                             deadlocks (seen on 2.6 with ``bash
                             .ci/torch-floor``; fixed by pytorch#154976)
===========================  ===============================================

``"inprocess"`` asked for explicitly on an older torch is refused at start.

Every worker of a job resolves the same way: the inputs are the job's config
and the plugin's hand-over, which are the same on every node, and the backend,
which is the same on every node of a job that can run at all.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch

from elastic_train.config.checks import torch_release
from elastic_train.config.job import JobConfig
from elastic_train.errors import ConfigError
from elastic_train.log import get_logger
from elastic_train.training.etcd_access import ETCD_ENV, EtcdAccess

log = get_logger(__name__)

#: The first torch whose ProcessGroup is destroyed without the GIL (pytorch#154976).
INPROCESS_MIN_TORCH = (2, 8)


def torch_reason(version: str = torch.__version__) -> str | None:
    """Why this torch cannot recover in process; None: it can."""
    if torch_release(version) >= INPROCESS_MIN_TORCH:
        return None
    return (
        f"torch {version} (in process needs torch >= 2.8: older releases destroy a "
        "gloo group holding the GIL, which can deadlock a survivor's re-form)"
    )


def restart_reason(
    cfg: JobConfig, *, backend: str, environ: Mapping[str, str] = os.environ,
    torch_version: str = torch.__version__,
) -> str | None:  # fmt: skip
    """Why ``"auto"`` runs the restart path for this worker; None: in process."""
    if (cfg.training.parallel, cfg.training.batch_mode) != ("ddp", "global"):
        return (
            f"training.parallel = {cfg.training.parallel!r} and training.batch_mode = "
            f"{cfg.training.batch_mode!r} (in process needs 'ddp' and 'global')"
        )
    blocker = torch_reason(torch_version)
    if blocker is not None:
        return blocker
    if backend != "gloo":
        return (
            f"the {backend} backend (in process runs gloo only: a peer's death inside "
            "a multi-rank NCCL collective is untested)"
        )
    access = EtcdAccess.find(environ)
    if access is None:
        return f"not started by torchrun with the etcd rendezvous ({ETCD_ENV} is unset)"
    if not access.signs(environ):
        return "no rendezvous secret reached the worker"
    return None


def resolve_recovery(
    cfg: JobConfig, *, backend: str, environ: Mapping[str, str] = os.environ,
    torch_version: str = torch.__version__,
) -> JobConfig:  # fmt: skip
    """``cfg`` with ``elastic.recovery`` "restart" or "inprocess" (``"auto"`` decided);
    the log line ``recovery_mode`` says which, and why "auto" ran the restart path."""
    requested = cfg.elastic.recovery
    blocker = torch_reason(torch_version)
    if requested == "inprocess" and blocker is not None:
        raise ConfigError(
            f"elastic.recovery = 'inprocess' cannot run on {blocker}; "
            "accepted here: 'auto' or 'restart'"
        )
    if requested != "auto":
        log.info("recovery_mode", mode=requested, requested=requested)
        return cfg
    reason = restart_reason(cfg, backend=backend, environ=environ, torch_version=torch_version)
    mode = "restart" if reason else "inprocess"
    log.info("recovery_mode", mode=mode, requested="auto", **({"reason": reason} if reason else {}))
    elastic = dataclasses.replace(cfg.elastic, recovery=mode)
    return dataclasses.replace(cfg, elastic=elastic)
