"""The token gateway: vLLM's and OpenAI's HTTP API on an engine rank, so environments and agent programs written
for them sample from rlrun's engines with exact token ids and log-probs (rlrun.gateway.server)."""
