"""A generated image task whose answer only the image gives: the prompt text is the same for every record, and
the picture's colour says what to write (red: digits, blue: letters, scored by the demo's rule,
rlrun.rewards.demo). Written in the layouts users bring: OpenRLHF-M's (a `message` column holding the chat as JSON
text, images as `file://` paths inside it, `answer` the label) or verl's (a `prompt` chat with an `<image>`
placeholder, an `images` column of {"bytes", "path"} entries, `reward_model.ground_truth` the label, in parquet).
`blank`: every picture grey, so nothing in the prompt tells the tasks apart (the control that must not learn)."""

from __future__ import annotations

import io
import json
import os
import random
from typing import Literal

QUESTION = "Write what the picture asks for:"
COLOURS = {"digits": (220, 30, 30), "letters": (30, 30, 220)}
BLANK = (128, 128, 128)
SIZE = 56


def _image(label: str, blank: bool, rng: random.Random):  # -> PIL.Image.Image
    from PIL import Image

    base = BLANK if blank else COLOURS[label]
    image = Image.new("RGB", (SIZE, SIZE), base)
    pixels = image.load()
    for _ in range(SIZE * SIZE // 8):  # speckles, so that no two pictures are byte-identical
        x, y = rng.randrange(SIZE), rng.randrange(SIZE)
        pixels[x, y] = tuple(min(255, max(0, c + rng.randint(-40, 40))) for c in base)
    return image


def write_colour_task(folder: str, records: int = 32, layout: Literal["openrlhf_m", "verl"] = "openrlhf_m",
                      blank: bool = False, seed: int = 0, absolute: bool = True) -> str:
    """Write the task under `folder` (images/ and the data file) and return the data file's path. `absolute`: image
    paths as `file://` URIs (OpenRLHF-M's), else relative to the data file's folder (a folder that may move)."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    rows = []
    for i in range(records):
        label = ("digits", "letters")[i % 2]
        image = _image(label, blank, rng)
        path = os.path.abspath(os.path.join(folder, "images", f"{i:04d}.png"))
        image.save(path)
        if layout == "openrlhf_m":
            ref = f"file://{path}" if absolute else os.path.join("images", f"{i:04d}.png")
            chat = [{"role": "user", "content": [{"type": "image", "image": ref},
                                                 {"type": "text", "text": QUESTION}]}]
            rows.append({"message": json.dumps(chat), "answer": label})
        else:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            rows.append({"data_source": "colour_task", "prompt": [{"role": "user", "content": f"<image>{QUESTION}"}],
                         "images": [{"bytes": buffer.getvalue(), "path": None}],
                         "reward_model": {"style": "rule", "ground_truth": label}, "extra_info": {"index": i}})
    if layout == "openrlhf_m":
        out = os.path.join(folder, "colour_task.jsonl")
        with open(out, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        return out
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = os.path.join(folder, "colour_task.parquet")
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out
