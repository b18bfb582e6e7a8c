"""Vision-language policies: prompt images (records, loading, preprocessing), the rows' images through the rollout
batch, the model's multimodal forward inputs, the vision tower, and a tiny Qwen2.5-VL for offline runs."""
