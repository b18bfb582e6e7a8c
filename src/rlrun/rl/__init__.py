"""The PPO loop and its assembly: the trainer (one step: generate, score, advantages, update, sync), the run
from config to teardown (run), planning and checking the run before launch (planning), building every role a
rank holds (build), where rollouts come from (rollout_source), the sleep/wake schedule (sleep), evaluation and
resume, and the memory plan --dry_run prints (model_shapes -> memory_estimate -> memory_plan -> memory_text).

Top tier beside supervised/: may import every folder below it.
"""
