"""Checkpoints: the on-disk format (store: step directories, the COMPLETE.json manifest, atomic publish,
validation, finding the newest valid one, pruning), which run a checkpoint belongs to and what a resume may change
(resume), the collective save and find every trainer shares and a role's DCP state (collective), and the one
checkpointer over a trainer's parts and its Stateful (checkpointer).

May import launch/ (its collectives), config/ and runtime/.
"""
