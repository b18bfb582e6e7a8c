"""One class per role and what trains it: Actor, Critic, Reference, RewardModel, the shared forward pass
(forward), optimizer and schedule (optim), the micro-batched update loop (update) and its saved state
(update_state), and writing a role's model in Hugging Face format (export).

Roles never touch torch.distributed: they get a strategy (strategies/) that does. May import strategies/,
data/, models/, algo/, config/ and runtime/.
"""
