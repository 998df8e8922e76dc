"""Code that runs in the torchrun agent process: the node agent (metrics endpoint, round timing,
zygote), and warm worker start.
"""
