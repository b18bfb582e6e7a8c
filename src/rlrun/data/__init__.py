"""Tokens on their way through a run: where records come from and how their fields are read (sources), prompt
datasets, their formatting and sampling (prompts), prompt images (images), rollout batches, their padded wire form
and per-rank result slots (rollout), the rows' images (vision_batch), sequence packing (packing), and which rows
each rank and micro-batch handles, with the seeds they draw from (batching).

May import models/ (the tiny demo tokenizer), config/ and runtime/.
"""
