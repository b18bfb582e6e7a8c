"""rlrun: Ray-free RLHF as one torch.distributed SPMD program."""

__version__ = "0.1.0"
