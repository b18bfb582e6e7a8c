"""RL math as pure tensor functions: advantages, returns, KL estimators and controllers, reward shaping and running
moments (algorithms), the policy and value losses with the train/rollout importance-sampling correction (losses),
log-probs through the vocabulary a chunk of positions at a time (vocab_chunks).

No collectives, no models, no config: shapes are in each docstring. Imports only torch and the standard library.
"""
