"""Supervised trainers (SFT, reward model, DPO) over the same run skeleton, strategies and checkpoints as PPO: the
loop (loop), the trainers the entry points declare (assembly), a task per trainer (tasks), their datasets and the
offline demo data (datasets), and OpenRLHF's losses (losses).

Top tier beside rl/: may import every folder below it.
"""
