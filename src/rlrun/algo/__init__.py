"""RL math as pure tensor functions: advantages, returns, KL estimators and controllers, reward shaping, running
moments and the on-policy distillation signal (algorithms); log-probs, entropy, loss aggregation and the value loss
(losses); the policy losses, PPO, GSPO and verl's registry (policy_losses); the engine/actor mismatch correction,
verl's and OpenRLHF's (rollout_correction); log-probs through the vocabulary a chunk of positions at a time
(vocab_chunks).

No collectives, no models, no config: shapes are in each docstring. Imports only torch and the standard library.
"""
