"""Building models and tokenizers: HF checkpoints and scalar-head (critic/reward) models (loading), and the tiny
models and tokenizer the demo and the tests build from a config with no download (tiny), and safetensors files
read a tensor at a time with pread (safetensors_read) and written a tensor at a time from a layout planned from
shapes (safetensors_stream).

May import config/ and runtime/.
"""
