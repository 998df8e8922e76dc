"""elastic_train: elastic, fault-tolerant PyTorch training on torchrun with an etcd v3 rendezvous."""

__version__ = "0.1.0"
