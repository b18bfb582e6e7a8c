"""What every layer uses and nothing depends on: the exception types (errors), the per-rank logger (log), phase
tracking and fault injection for the failure tests (faults), importing user .py files (pyfile), seeding (seeding).

The bottom tier: imports only the standard library, torch and numpy, never another rlrun folder.
"""
