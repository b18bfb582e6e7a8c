"""Training strategies: how one role's model is sharded and stepped on its process group (see base.py)."""
