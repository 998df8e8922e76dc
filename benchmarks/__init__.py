"""Side-by-side benchmarks of elastic_train against torchrun's own rendezvous
backends: recovery, scale-up, preemption, throughput, checkpoint cost and
rendezvous scale. Run one with ``python -m benchmarks.<name> --repeats N``;
``python -m benchmarks.report`` turns ``benchmarks/results/*.json`` into the
README table and plots.
"""
