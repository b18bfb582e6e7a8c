"""Starting, wiring and stopping the SPMD world: reading the launcher environment (env), initialising the
default group (dist), the pure role layout and its planning and printing (layout, layout_plan, layout_text,
labels, label_placement), making every process group in one place (groups), moving tensors between roles
(transfer, param_blocks), collective DCP and checkpoint save/load (dcp, checkpoint_sync), and the one-line
failure report a failing rank leaves (failures).

The only folder besides strategies/ that touches torch.distributed. May import checkpoint/ and runtime/.
"""
