"""`--model_preset tiny-vl`: the offline VLM demo's model and data, built on first use into rlrun's cache and read
from there like any saved model (`--pretrain`) and data file (`--prompt_data`), so the same code path runs the demo
and a user's own VLM. Every rank may build at once: each writes a private folder and renames it into place (the
first rename wins; the folders are identical for the same seed)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from rlrun.config.data import DataConfig
from rlrun.config.model import VL_PRESET, PretrainedConfig
from rlrun.models.tiny import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, build_byte_tokenizer, build_causal_lm
from rlrun.runtime.cache import built_once, cache_root

# ---- the tiny model ----------------------------------------------------------------------------------------------
# A tiny Qwen2.5-VL-class model built from config, saved the way `save_pretrained` lays a hub VLM out (config.json,
# safetensors, tokenizer files with a vision-aware chat template, preprocessor_config.json): the offline stand-in for
# Qwen2.5-VL-3B-Instruct in tests, the VLM demo and benchmarks. Nothing here touches the network.

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
# Ids follow the byte tokenizer's (bytes, then pad/bos/eos), in VISION_TOKENS' order.
VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = range(BYTE_VOCAB_SIZE, BYTE_VOCAB_SIZE + 4)
VL_VOCAB_SIZE = BYTE_VOCAB_SIZE + len(VISION_TOKENS)
# Each 28x28 block of pixels (a merged 2x2 group of 14-pixel patches) is one token: 56x56 images give 4.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112

# Qwen2.5-VL's convention in the byte tokenizer's plain chat format: an image entry of a message's content list
# ({"type": "image", ...}, or any entry with an "image" key) becomes <|vision_start|><|image_pad|><|vision_end|>,
# which the image processor's grid expands to one pad token per merged patch.
VL_CHAT_TEMPLATE = (
    "{% macro render(content) %}{% if content is string %}{{ content }}{% else %}{% for part in content %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    + VISION_START
    + IMAGE_PAD
    + VISION_END
    + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ render(message['content']) }}\n"
    "{% elif message['role'] == 'user' %}User: {{ render(message['content']) }}\n"
    "{% else %}Assistant: {{ render(message['content']) }}{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


def build_vl_tokenizer() -> PreTrainedTokenizerFast:
    """The byte tokenizer plus Qwen2-VL's vision tokens (ids VISION_START_ID..VIDEO_PAD_ID) and VL_CHAT_TEMPLATE."""
    tokenizer = build_byte_tokenizer()
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    assert ids == [VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID], ids
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def tiny_vl_config() -> Qwen2_5_VLConfig:
    """A ~0.2M-parameter Qwen2.5-VL: the text model of rlrun's tiny Qwen2 (head_dim 32, as vLLM's CPU attention
    needs) and a 2-block vision tower of width 32 (14-pixel patches, 2x2 merge, one windowed and one full block)."""
    text: dict[str, Any] = {
        "vocab_size": VL_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        "tie_word_embeddings": False,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "in_channels": 3,
    }
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        **text,
    )


def tiny_image_processor() -> Qwen2VLImageProcessorPil:
    # The PIL processor: the default one needs torchvision, which has no build for rlrun's CPU torch.
    return Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2, temporal_patch_size=2
    )


def save_tiny_vl(path: str | os.PathLike[str], seed: int = 0, dtype: torch.dtype = torch.float32) -> str:
    """Build the tiny VLM (identical for the same seed) and save model, tokenizer and image processor to `path`."""
    model = build_causal_lm(tiny_vl_config(), seed=seed, dtype=dtype)
    model.save_pretrained(path)
    build_vl_tokenizer().save_pretrained(path)
    tiny_image_processor().save_pretrained(path)
    return str(path)


# ---- the image task ----------------------------------------------------------------------------------------------
# A generated image task whose answer only the image gives: the prompt text is the same for every record, and
# the picture's colour says what to write (red: digits, blue: letters, scored by the demo's rule,
# rlrun.rewards.demo). Written in the layouts users bring: OpenRLHF-M's (a `message` column holding the chat as JSON
# text, images as `file://` paths inside it, `answer` the label) or verl's (a `prompt` chat with an `<image>`
# placeholder, an `images` column of {"bytes", "path"} entries, `reward_model.ground_truth` the label, in parquet).
# `blank`: every picture grey, so nothing in the prompt tells the tasks apart (the control that must not learn).

QUESTION = "Write what the picture asks for:"
COLOURS = {"digits": (220, 30, 30), "letters": (30, 30, 220)}
BLANK = (128, 128, 128)
SIZE = 56


def _image(label: str, blank: bool, rng: random.Random):  # -> PIL.Image.Image
    from PIL import Image  # noqa: PLC0415 - only the VLM demo draws images

    base = BLANK if blank else COLOURS[label]
    image = Image.new("RGB", (SIZE, SIZE), base)
    pixels = image.load()
    assert pixels is not None  # an image in memory
    for _ in range(SIZE * SIZE // 8):  # speckles, so that no two pictures are byte-identical
        x, y = rng.randrange(SIZE), rng.randrange(SIZE)
        pixels[x, y] = tuple(min(255, max(0, c + rng.randint(-40, 40))) for c in base)
    return image


def write_colour_task(
    folder: str,
    records: int = 32,
    layout: Literal["openrlhf_m", "verl"] = "openrlhf_m",
    blank: bool = False,
    seed: int = 0,
    absolute: bool = True,
) -> str:
    """Write the task under `folder` (images/ and the data file) and return the data file's path. `absolute`: image
    paths as `file://` URIs (OpenRLHF-M's), else relative to the data file's folder (a folder that may move)."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    rows: list[dict[str, Any]] = []
    for i in range(records):
        label = ("digits", "letters")[i % 2]
        image = _image(label, blank, rng)
        path = os.path.abspath(os.path.join(folder, "images", f"{i:04d}.png"))
        image.save(path)
        if layout == "openrlhf_m":
            ref = f"file://{path}" if absolute else os.path.join("images", f"{i:04d}.png")
            chat = [{"role": "user", "content": [{"type": "image", "image": ref}, {"type": "text", "text": QUESTION}]}]
            rows.append({"message": json.dumps(chat), "answer": label})
        else:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            rows.append(
                {
                    "data_source": "colour_task",
                    "prompt": [{"role": "user", "content": f"<image>{QUESTION}"}],
                    "images": [{"bytes": buffer.getvalue(), "path": None}],
                    "reward_model": {"style": "rule", "ground_truth": label},
                    "extra_info": {"index": i},
                }
            )
    if layout == "openrlhf_m":
        out = os.path.join(folder, "colour_task.jsonl")
        with open(out, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        return out
    import pyarrow as pa  # noqa: PLC0415 - optional extra (rlrun[data])
    import pyarrow.parquet as pq  # noqa: PLC0415

    out = os.path.join(folder, "colour_task.parquet")
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


PRESET = VL_PRESET
VERSION = 2  # bump when the model or the task changes: older cache folders are then not reused


def resolve_vl_preset(m: PretrainedConfig, d: DataConfig, seed: int) -> tuple[PretrainedConfig, DataConfig]:
    """The model and data sections with --model_preset tiny-vl turned into --pretrain (the tiny Qwen2.5-VL for
    --seed) and, without --prompt_data, the colour task in OpenRLHF-M's layout (--input_key message --label_key
    answer)."""
    if m.model_preset != PRESET or m.pretrain is not None:
        return m, d
    root = os.path.join(cache_root(), f"{PRESET}-v{VERSION}")
    model = built_once(os.path.join(root, f"model-seed{seed}"), lambda path: save_tiny_vl(path, seed=seed))
    m = dataclasses.replace(m, pretrain=model)
    if d.prompt_data is None:
        data = built_once(
            os.path.join(root, "colour_task"), lambda path: write_colour_task(path, records=32, absolute=False)
        )
        d = dataclasses.replace(d, prompt_data=os.path.join(data, "colour_task.jsonl"))
    return m, d
