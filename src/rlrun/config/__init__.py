"""The one typed config tree: the sections every trainer reads and rlrun.ppo's (schema), the supervised trainers'
trees (supervised), and its reflection (fields: every field by flag name, coercion, redaction of secrets). A
component receives its own section; checks across sections run in rlrun.plan.

May import runtime/ only.
"""
