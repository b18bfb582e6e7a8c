"""The `native` backend: rlrun's own KV-cache decoder over the trainer's own modules (Llama, Qwen2/3, Mistral, their
MoE variants), with static-shape CUDA-graph steps, continuous batching within a KV budget, and each sampled token's
log-probability; reached through rlrun.engines.build.

May import engines/protocol.py and the layers below engines/.
"""
