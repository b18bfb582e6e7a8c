"""Where scores come from when no reward model does: reward functions from a .py file or an HTTP URL
(reward_fn), verl's compute_score convention (compute_score) and rule scorers with Search-R1's exact match (rules),
the demo task's rule (demo), and the reward server behind `python -m rlrun.reward_server` (server).

May import data/ (the prompts' metadata), serving/ (the HTTP client and server machinery) and runtime/.
"""
