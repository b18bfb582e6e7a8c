"""Supervised trainers (SFT, reward model, DPO) over the same launch, strategy and checkpoint machinery as PPO."""
