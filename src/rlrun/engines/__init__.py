"""Generation engines: the engine surface and the HF `generate` engine (base), rlrun's own KV-cache decoder
(native, decoder, sampling), stop strings (stops), the backend choice (choice), and vLLM inside the rank or
in a child process.

Every vLLM import and call lives in vllm_adapter.py. hosting.py chooses the host from the layout: in_process.py
(vLLM's external_launcher, only when the engine ranks are the whole world) or vllm_engine.py (a spawned child
per engine, vllm_child.py; tensor parallel > 1 through tensor_parallel.py). May import launch/ (the layout),
data/, models/, config/ and runtime/.
"""
