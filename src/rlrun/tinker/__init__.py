"""rlrun.tinker: the Tinker training API served from one torchrun/srun job (rank 0 serves HTTP, every rank trains
and samples); `torchrun -m rlrun.tinker --pretrain MODEL ...`. See docs/tinker.md."""
