"""Training scripts of the usual tutorial shape that the benchmarks run under
torchrun's own rendezvous backends."""
