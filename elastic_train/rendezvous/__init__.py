"""The etcd v3 rendezvous for torchrun: the handler and its backend (the state and heartbeat
keys), the rules where it departs from torch's handler, liveness on each agent's own clock,
and the rdzv-conf parser (which also decides how values are signed).

Imports nothing above etcd/: the node agent's keys reach it from the torchrun plugin.
"""
