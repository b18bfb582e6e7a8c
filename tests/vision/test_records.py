"""Prompt images in the layouts users bring (OpenRLHF-M's JSON-text `message`, OpenRLHF 0.11's message list + images
column, verl's parquet with `<image>` placeholders and {"bytes", "path"} images), and every image form loading (or
failing with one error naming the record)."""

from __future__ import annotations

import base64
import dataclasses
import io

import numpy as np
import pytest
from PIL import Image

from rlrun.config.tree import Config
from rlrun.data.prompts import PromptKeys, load_prompt_records
from rlrun.data.sources import DataSpec
from rlrun.models.tiny import build_byte_tokenizer
from rlrun.plan.preflight import ppo_prompts
from rlrun.runtime.errors import DataError
from rlrun.vision.demo import write_colour_task
from rlrun.data.images import load_image
from rlrun.data.images import images_of


def _png(colour=(10, 200, 30), size=(6, 4)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_openrlhf_m_json_text_messages_with_file_uris(tmp_path):
    """MathV60K's layout: `message` is a chat as JSON text, images as file:// paths inside it; `answer` the label."""
    path = write_colour_task(str(tmp_path), records=4)
    records = load_prompt_records(path, PromptKeys("message", "answer"))
    assert [r.label for r in records] == ["digits", "letters", "digits", "letters"]
    first = records[0]
    assert first.prompt == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": first.prompt[0]["content"][1]["text"]}]}]
    assert len(first.images) == 1 and first.images[0].startswith("file://")
    assert load_image(first.images[0], "r0").getpixel((0, 0)) is not None
    assert first.base_dir == str(tmp_path)


def test_verl_parquet_with_placeholders_and_image_bytes(tmp_path):
    """verl's geo3k layout: prompt chat with `<image>` in its text, `images` a list of {"bytes", "path"} structs."""
    path = write_colour_task(str(tmp_path), records=4, layout="verl")
    records = load_prompt_records(path, PromptKeys("prompt", "reward_model.ground_truth"))
    assert [r.label for r in records] == ["digits", "letters", "digits", "letters"]
    content = records[1].prompt[0]["content"]
    assert content[0] == {"type": "image"} and content[1]["type"] == "text" and "<image>" not in content[1]["text"]
    image = load_image(records[1].images[0], "r1")
    assert image.size == (56, 56) and image.getpixel((0, 0))[2] > 150  # blue: letters


def test_openrlhf_011_message_list_with_images_column():
    """OpenRLHF 0.11: {"type": "image"} entries (no payload) in the messages, the images in their own column."""
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}]}]
    prompt, images = images_of(chat, ["a.png", "b.png"], "r", "images")
    assert images == ("a.png", "b.png")
    assert prompt[1]["content"][1:] == [{"type": "image"}, {"type": "image"}] and prompt[0] == chat[0]
    assert images_of("plain text", None, "r", "images") == ("plain text", ())


@pytest.mark.parametrize("chat, column, message", [
    ([{"role": "user", "content": "<image> and <image>"}], ["a.png"], "1 images in 'images' but its prompt shows 2"),
    ([{"role": "user", "content": "no placeholder"}], ["a.png"], "shows 0 image places"),
    ([{"role": "user", "content": [{"type": "image", "image": "x.png"}]}], ["a.png"], "both inside its messages"),
    ([{"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "image"}]}], None, "without an image"),
])
def test_images_and_places_must_agree(chat, column, message):
    with pytest.raises(DataError, match=message):
        images_of(chat, column, "data.jsonl: record 7", "images")


def test_every_image_form_loads(tmp_path):
    png = _png()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.png").write_bytes(png)
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    forms = [str(tmp_path / "sub" / "x.png"), f"file://{tmp_path / 'sub' / 'x.png'}", png, {"bytes": png, "path": None},
             {"bytes": None, "path": str(tmp_path / "sub" / "x.png")}, {"image_url": {"url": uri}}, uri,
             Image.open(io.BytesIO(png)).convert("L"), np.full((4, 6, 3), 7, dtype=np.uint8), "sub/x.png"]
    for ref in forms:
        image = load_image(ref, "r", base_dir=str(tmp_path))
        assert image.mode == "RGB" and image.size == (6, 4), ref


@pytest.mark.parametrize("ref, message", [
    ("missing.png", r"data.jsonl: record 3: image 'missing.png' not found"),
    (b"not an image", r"record 3: image <12 bytes> is not a readable image"),
    ("data:image/png;base64,@@@", r"record 3: .* base64 payload does not decode"),
    ({"caption": "x"}, r"record 3: image .* has none of the keys"),
    (3.5, r"record 3: image 3.5 \(float\) is not a path"),
])
def test_unreadable_images_name_the_record(ref, message):
    with pytest.raises(DataError, match=message):
        load_image(ref, "data.jsonl: record 3")


def test_a_text_policy_refuses_image_records(tmp_path):
    """Images given to a text-only policy would be dropped without a word: refused before anything starts."""
    path = write_colour_task(str(tmp_path), records=2)
    cfg = Config()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, prompt_data=path, input_key="message",
                                                            label_key="answer"))
    with pytest.raises(DataError, match=r"record 0 has images, but the policy tiny is a text-only model"):
        ppo_prompts(cfg, build_byte_tokenizer(), DataSpec(path))
