"""Training strategies: how one role's model is sharded, stepped, slept and saved on its process group: FSDP2
(fsdp, with re-homing a one-rank actor into weight sync's send buckets), DeepSpeed (deepspeed: the one adapter
module), parking tensors for sleep (parking), the full-parameter view of a sharded model that weight sync and the
HF export read (blocks), and the one place --strategy is read (choose). See base.py for the surface every strategy
offers, and a role's model and optimizer as a checkpoint part.

Uses torch.distributed only through the role's group. May import checkpoint/, models/, config/ and runtime/.
"""
