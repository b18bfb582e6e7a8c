"""Where multi-turn episodes come from besides OpenRLHF agent files: programs and environments written for the
OpenAI and vLLM APIs, sampling through the token gateway (rlrun.gateway)."""
