"""RL math as pure tensor functions: advantages, returns, KL estimators and controllers (algorithms), the policy
and value losses (losses), off-policy importance-sampling correction (is_correction), running moments (running).

No collectives, no models, no config: shapes are in each docstring. Imports only torch and the standard library.
"""
