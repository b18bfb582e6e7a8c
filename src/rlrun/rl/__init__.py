"""The PPO loop: the step, top to bottom (trainer: generate, score, advantages, update, sync, metrics), the same
phases one step ahead for --async_train (async_loop), where rollouts come from (rollouts, and partial_rollout's
sequences in flight), --dynamic_batch's token budgets (dynamic_batch), the sleep/wake schedule (sleep), evaluation,
and the assembly that builds all of it from the config for the run skeleton (assembly).

Top tier beside supervised/: may import every folder below it.
"""
