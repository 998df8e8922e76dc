"""Training state at rest: checkpoints on disk, snapshots in shared memory, their encodings and the
restore decision.
"""
