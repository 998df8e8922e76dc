"""etcd v3: the client (the only module that imports pyetcd), the watched-key and lease helpers,
the torch Store, and the etcd server runner.
"""
