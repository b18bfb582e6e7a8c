"""Tokens on their way through a run: prompt datasets and sampling (prompts), rollout batches and their padded
wire form (rollout), sequence packing (packing), deterministic sharding and mini-batch order (batching),
per-rank result slots for gathers (results), and tensors written for another process (tensor_files).

May import models/ (the tiny demo tokenizer), config/ and runtime/.
"""
