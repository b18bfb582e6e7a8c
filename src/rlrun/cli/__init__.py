"""Command lines into the config tree: argv and YAML, in rlrun's, OpenRLHF's and verl's spellings, parsed
into a validated Config, with ignored flags reported once (parser).

May import compat/ (the peers' spellings), config/ and runtime/.
"""
