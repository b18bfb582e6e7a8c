"""Generation engines beyond HF `generate`: vLLM in a child process (see vllm_engine.py).

Every vLLM import and call lives in vllm_adapter.py; vllm_child.py hosts the adapter in a spawned
process; vllm_engine.py is the engine surface the trainer sees.
"""
