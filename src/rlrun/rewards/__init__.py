"""Where scores come from when no reward model does: reward functions from a .py file or an HTTP URL
(reward_fn), the demo task's rule (demo), reward shaping and filtering of scores (shaping), and the reward
server behind `python -m rlrun.reward_server` (server).

May import serving/ (the HTTP client and server machinery) and runtime/.
"""
