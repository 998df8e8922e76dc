"""The exceptions elastic_train raises.

Errors from etcd, gRPC, the OS and torch are translated into these at one
boundary each (``raise X from exc``), so callers never catch third-party types::

    ElasticTrainError
    ├── ConfigError (also ValueError)       bad config file, override or CLI value
    ├── EtcdError                           etcd client failures outside the rendezvous
    │   └── EtcdUnavailableError            no endpoint answered within the deadline
    ├── EtcdServerError                     an embedded etcd server did not start
    ├── EtcdValueRejectedError              a value read from etcd failed its MAC check
    ├── CheckpointError
    │   ├── CheckpointCorruptError          manifest/checksum/format mismatch
    │   ├── CheckpointMismatchError         saved under an incompatible config
    │   └── CheckpointWriteError            a save failed (disk full, permission, I/O)
    ├── SnapshotError                       shared-memory snapshot unusable
    │   └── SnapshotRefusedError            a snapshot directory or file we must not trust
    ├── MetricsPortsTakenError              every port the metrics endpoint may try is in use
    ├── DataLoadingError                    a DataLoader worker failed or died
    ├── ClusterError                        the local cluster runner failed
    └── InProcessRecoveryError              survivors could not re-form the group in place
        └── MemberLostError                 a member died while the group re-formed (retried)

The rendezvous backend raises torch's own ``RendezvousConnectionError`` and
``RendezvousStateError``, because torchrun's agent catches those by type.

Exit codes a worker uses so that the agent, Kubernetes ``podFailurePolicy``
and Slurm can tell failures apart:
"""

from __future__ import annotations

#: A configuration error: retrying cannot help, so Kubernetes fails the Job.
EXIT_CONFIG_ERROR = 78  # EX_CONFIG from sysexits.h
#: The hang watchdog fired: no step completed within the timeout.
EXIT_HANG = 75
#: Too many consecutive checkpoint write failures.
EXIT_CHECKPOINT_FAILURES = 74
#: A peer was preempted: this rank saved and leaves so its agent re-rendezvouses.
EXIT_PEER_PREEMPTED = 73


class ElasticTrainError(Exception):
    """Base class of every error raised by elastic_train."""


class ConfigError(ElasticTrainError, ValueError):
    """A configuration value is invalid; the message names the field."""


class EtcdError(ElasticTrainError):
    """An etcd request failed."""


class EtcdUnavailableError(EtcdError):
    """No etcd endpoint answered within the deadline."""


class EtcdServerError(ElasticTrainError):
    """An embedded etcd server could not be started or stopped."""


class EtcdValueRejectedError(ElasticTrainError):
    """A value read from etcd failed its MAC or framing check and was not used.

    Forged, replayed from another key or run, written with another secret, or
    corrupt; the message names the etcd key. Not an :class:`EtcdError`: etcd
    answered, so this is never retried as an outage.
    """


class CheckpointError(ElasticTrainError):
    """A checkpoint could not be saved or loaded."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint on disk is incomplete, truncated or fails its checksum."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint was written under a configuration this run cannot resume."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (disk full, permission denied, I/O error)."""


class SnapshotError(ElasticTrainError):
    """A shared-memory snapshot is missing, torn or does not fit."""


class SnapshotRefusedError(SnapshotError):
    """A snapshot directory or file is a symlink, foreign-owned or open to others."""


class MetricsPortsTakenError(ElasticTrainError):
    """Every port the node's metrics endpoint may try is in use (the agent serves no metrics)."""


class DataLoadingError(ElasticTrainError):
    """A DataLoader worker process failed or died while loading micro-batches."""


class ClusterError(ElasticTrainError):
    """The local cluster runner could not start or supervise its nodes."""


class InProcessRecoveryError(ElasticTrainError):
    """Survivors could not re-form the process group in place (fenced out, no
    agreement in time, too many failures); the worker exits to the restart path."""


class MemberLostError(InProcessRecoveryError):
    """A member of the agreed generation died before the group formed: agree again."""
