"""Peer command-line spellings mapped onto rlrun's config fields.

``openrlhf_flags``: OpenRLHF 0.11 dotted flags (``--actor.num_nodes``); ``verl_overrides``: verl/Hydra
``key=value`` overrides. Both rewrite argv into rlrun's own (OpenRLHF classic) flag names before parsing,
so precedence stays positional: later on the command line wins. ``openrlhf_checkpoint``, ``openrlhf_reader``
and ``openrlhf_init`` read OpenRLHF's saved checkpoints; ``report`` (an entry point: `python -m
rlrun.compat.report`) writes docs/compat.md from all of it.

May import checkpoint/, config/ and runtime/ (report, as an entry point, anything).
"""
