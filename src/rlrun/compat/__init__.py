"""Peer command-line spellings and checkpoints mapped onto rlrun's.

``openrlhf_flags``: OpenRLHF 0.11 dotted flags (``--actor.num_nodes``) of every trainer; ``verl_overrides`` (with
its table ``verl_keys``): verl/Hydra ``key=value`` overrides. Both rewrite argv into rlrun's own (OpenRLHF classic)
flag names before parsing, so precedence stays positional: later on the command line wins (``argv`` holds what
they share). ``openrlhf_checkpoint`` reads OpenRLHF's saved DeepSpeed checkpoints and starts a run from one;
scripts/compat_report.py writes docs/compat.md from all of it.

May import models/, config/ and runtime/.
"""
