"""Supervised trainers (SFT, reward model, DPO) over the same launch, strategy and checkpoint machinery as PPO:
one loop (loop, run), a task per trainer (sft_task, rm_task, dpo_task), their datasets and batches, losses and
checkpointing.

Top tier beside rl/: may import every folder below it.
"""
