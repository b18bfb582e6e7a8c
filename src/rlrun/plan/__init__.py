"""Everything that runs before a GPU is touched: a trainer's command line planned (plan: resolved, checked, and for
rlrun.ppo its generation backend and role layout), the layout's placement by size and node label (layout), every
value and cross-field check (checks), the memory plan per rank from the models' config.json alone (shapes, memory,
memory_text), and what a job reads first, read as the run will (preflight). `--dry_run` is this folder.

May import every folder below the trainers (engines/, strategies/, roles/ and what they import).
"""
