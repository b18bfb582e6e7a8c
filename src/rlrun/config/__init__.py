"""The typed config: one module per section, owned by the component that reads it and holding its own rules
(`check()`); rlrun.ppo's tree of them (tree) and the supervised trainers' (supervised); and its reflection (fields:
every field by flag name, coercion, redaction of secrets). A component receives its own section; rules across
sections run in rlrun.plan, peer spellings are translated in rlrun.compat.

May import runtime/ only (and algo/ lazily, in a check that needs the policy losses).
"""
