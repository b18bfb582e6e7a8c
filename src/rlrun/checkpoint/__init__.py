"""The on-disk checkpoint format: step directories, the COMPLETE.json manifest, atomic publish, validation,
finding the newest valid checkpoint and pruning (store). Pure file operations; the collective save and load
that use them live in rlrun.launch.checkpoint_sync and rlrun.launch.dcp.

May import runtime/ only.
"""
