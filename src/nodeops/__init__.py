"""nodeops: prepare GPU machines and launch multi-node PyTorch training on them."""

__version__ = "0.1.0"
