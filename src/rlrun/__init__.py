"""rlrun: Ray-free RLHF as one SPMD program (torchrun or srun), roles talking through collectives."""

__version__ = "0.1.0"
