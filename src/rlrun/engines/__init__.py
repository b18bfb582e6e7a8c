"""Generation engines: the engine surface, stop strings and the HF `generate` engine (base), rlrun's own KV-cache
decoder and engine (decoder, native), vLLM in its own folder (vllm/), and building this rank's engine from the
generation settings (build: the one place a backend is chosen).

May import weight_sync/ (how an engine takes the actor's weights), launch/ (the layout, the engine's group),
data/, models/, config/ and runtime/.
"""
