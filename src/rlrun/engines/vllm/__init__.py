"""The vLLM backend: every vLLM import and call (adapter); where an engine runs and how much GPU it asks for
(placement: inside the rank with vLLM's external_launcher only when the engine ranks are the whole world, else a
child process); the in-process host (in_process), the child host and its tensor-parallel ranks (engine, child);
handing memory to the child without a copy (handoff); and weight syncs streamed to it bucket by bucket (stream).
"""
