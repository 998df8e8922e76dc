"""elastic_train: elastic, fault-tolerant PyTorch training on torchrun and etcd v3."""

__version__ = "0.1.0"
