"""Training strategies: how one role's model is sharded, stepped, slept and saved on its process group: FSDP2
(fsdp, fsdp_homing), DeepSpeed (deepspeed_adapter, deepspeed_state, deepspeed_zero3), parking for sleep,
and the checks that refuse unsupported settings before launch (checks, choose). See base.py for the surface.

Uses torch.distributed only through the role's group. May import launch/, config/ and runtime/.
"""
