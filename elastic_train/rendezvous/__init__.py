"""The etcd v3 rendezvous for torchrun: the backend, the rules where it departs from torch's
handler, the value codec and the rdzv-conf parser.

Imports nothing above etcd/: the node agent's keys reach it from the torchrun plugin.
"""
