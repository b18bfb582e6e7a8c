"""Generation engines: the surface every backend offers (protocol: sample, weights, load_weights; stop strings), the
backends (hf: transformers' generate; native/: rlrun's own KV-cache decoder; vllm/: vLLM in or beside the rank), and
build, the one place a backend is chosen by name and the only module the rest of rlrun imports a backend through.

May import weight_sync/ (how an engine takes the actor's weights), launch/ (the layout, the engine's group),
data/, models/, config/ and runtime/.
"""
