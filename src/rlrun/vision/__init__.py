"""Vision-language policies: a model's image processor and its multimodal forward inputs for padded and packed rows
and HF generate (inputs), the vision tower (tower), and the offline demo's tiny Qwen2.5-VL and its image task
(demo).

May import data/, models/, config/ and runtime/.
"""
