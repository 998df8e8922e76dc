"""etcd v3: the client (the only module that imports pyetcd), the watched-key and lease helpers,
the codec that signs and checks every value, the torch Store, and the etcd server runner.
"""
