"""Starting, wiring and stopping the SPMD world: reading the launcher environment (env), initialising and tearing
down the default group and watching its collectives (dist), what a role layout is and how it prints (layout),
making every process group in one place (groups), moving tensors between roles (transfer), and the one-line
failure report a failing rank leaves (failures).

With strategies/, checkpoint/ and weight_sync/ the only folders that touch torch.distributed; the only one that
creates groups. May import config/ and runtime/.
"""
