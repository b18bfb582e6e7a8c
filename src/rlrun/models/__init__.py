"""Building models and tokenizers: HF checkpoints and scalar-head (critic/reward) models (loading), and the tiny
models and tokenizer the demo and the tests build from a config with no download (tiny).

May import config/ and runtime/.
"""
