"""Building models and tokenizers: HF checkpoints and scalar-head (critic/reward) models (loading), which auto class
builds a policy (architecture), hub ids resolved to cached folders (hub), LoRA adapters through PEFT (lora) and
adapter folders as a model path (adapter_pretrain), initial weights read a slice at a time (weights), safetensors
files read and written a tensor at a time (safetensors), and the tiny models and tokenizer the demo and the tests
build from a config with no download (tiny).

May import config/ and runtime/.
"""
