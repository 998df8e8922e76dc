"""One machine as a cluster: embedded etcd, torchrun agents as nodes, the chaos schedule, progress
and process-tree signals.
"""
