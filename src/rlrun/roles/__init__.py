"""One class per role: the actor and the reference (actor), the critic and the reward model (critic), the shared
forward passes (forward), the micro-batched update loop with its optimizer, schedule and saved state (update), and
writing a role's model in Hugging Face format (export).

Roles never touch torch.distributed: they get a strategy (strategies/) that does. May import strategies/,
data/, models/, algo/, config/ and runtime/.
"""
