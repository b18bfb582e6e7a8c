"""What every layer uses and nothing depends on: the exception types and storage failures (errors), the per-rank
logger (log), a rank's phases with the watchdog, deadlines and fault injection for the failure tests (phases), this
process's memory (memory), importing user .py files (pyfile), and what a secret looks like (secrets).

The bottom tier: imports only the standard library, torch and numpy, never another rlrun folder.
"""
