"""Images as prompt datasets hold them, opened as RGB PIL images.

The forms users bring (OpenRLHF-M / qwen_vl_utils' `fetch_image`, verl's `process_image`, HF datasets' Image
feature): a local path (absolute, relative to the working directory, or relative to the data file's folder), a
`file://` URI, an `http(s)://` URL, a `data:image/...;base64,` URI, raw encoded bytes, a `{"bytes": ..., "path": ...}`
mapping (parquet and datasets' Image columns), a PIL image, or an [H, W, C] uint8 array. Every failure is one
DataError naming the record and the image.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import numpy as np

from rlrun.runtime.errors import DataError

# ---- image records -----------------------------------------------------------------------------------------------
# Where a prompt record keeps its images, in the two layouts users bring:
#
# - OpenRLHF-M / OpenRLHF's VLM datasets: a chat whose message `content` is a list mixing
#   `{"type": "image", "image": <path, URL, data URI, ...>}` and `{"type": "text", "text": ...}` entries;
# - verl (and Search-R1-style preprocessing): an `images` column (`data.image_key`) of images in order, and `<image>`
#   placeholders in the prompt's text that say where each goes.
#
# Both become one form: a chat whose image entries are `{"type": "image"}` (what chat templates render as the model's
# image tokens) and the images' references in order, loaded later (rlrun.data.images) on the ranks that generate.

IMAGE_PLACEHOLDER = "<image>"
_PLACEHOLDER_SPLIT = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)})")
Messages = list[dict[str, Any]]


def is_image_entry(part: Any) -> bool:
    return isinstance(part, Mapping) and (
        part.get("type") in ("image", "image_url") or "image" in part or "image_url" in part
    )


def _image_ref(part: Mapping[str, Any]) -> Any:
    for key in ("image", "image_url", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    return None


def _with_placeholders(text: str) -> list[dict[str, Any]]:
    parts = [s for s in _PLACEHOLDER_SPLIT.split(text) if s]
    return [{"type": "image"} if s == IMAGE_PLACEHOLDER else {"type": "text", "text": s} for s in parts]


def images_of(
    prompt: str | Messages, column: Any, where: str, image_key: str
) -> tuple[str | Messages, tuple[Any, ...]]:
    """(prompt with image entries reduced to {"type": "image"}, the images in the order the prompt shows them).

    `column`: the record's --image_key value (None when it has none). Images come from the chat's image entries, or
    from the column placed at the `<image>` placeholders (verl); a text-only record gives (prompt, ())."""
    inline: list[Any] = []
    listed = [] if column is None else (list(column) if isinstance(column, (list, tuple)) else [column])
    if isinstance(prompt, str):
        if not listed:
            return prompt, ()
        prompt = [{"role": "user", "content": prompt}]
    placeholders = 0
    messages: Messages = []
    for message in prompt:
        content = message.get("content")
        if isinstance(content, str) and listed and IMAGE_PLACEHOLDER in content:
            content = _with_placeholders(content)
        if isinstance(content, list):
            parts = []
            for part in content:
                if is_image_entry(part):
                    ref = _image_ref(part)
                    if ref is None:
                        placeholders += 1
                    else:
                        inline.append(ref)
                    parts.append({"type": "image"})
                else:
                    parts.append(dict(part) if isinstance(part, Mapping) else part)
            content = parts
        messages.append({**message, "content": content})
    if inline and listed:
        raise DataError(f"{where} has images both inside its messages and in {image_key!r}; keep one of the two.")
    if inline:
        if placeholders:
            raise DataError(
                f"{where} has {placeholders} image entries without an image (no 'image' value) besides "
                f"{len(inline)} with one; give every image entry its image."
            )
        return messages, tuple(inline)
    if placeholders != len(listed):
        hint = (
            f" Put one {IMAGE_PLACEHOLDER!r} in the prompt text per image (verl's convention), or image entries "
            'in the message content ({"type": "image", "image": ...}).'
        )
        raise DataError(
            f"{where} has {len(listed)} images in {image_key!r} but its prompt shows {placeholders} image places.{hint}"
        )
    return messages, tuple(listed)


URL_TIMEOUT_S = 30.0
_DATA_URI = "data:image"


def _shown(ref: Any) -> str:
    if isinstance(ref, (bytes, bytearray)):
        return f"<{len(ref)} bytes>"
    if isinstance(ref, Mapping):
        return "{" + ", ".join(f"{k!r}: {_shown(v)}" for k, v in ref.items()) + "}"
    text = repr(ref)
    return text if len(text) <= 100 else text[:97] + "..."


def _decoded(data: bytes, where: str, ref: Any) -> Any:
    from PIL import Image, UnidentifiedImageError  # noqa: PLC0415 - only VLM runs read images

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DataError(
            f"{where}: image {_shown(ref)} is not a readable image ({exc}); fix or remove the record."
        ) from exc
    return image


def _local(path: str, base_dir: str | None, where: str, ref: Any) -> bytes:
    candidates = [path] if os.path.isabs(path) or base_dir is None else [path, os.path.join(base_dir, path)]
    for candidate in candidates:
        if os.path.isfile(candidate):
            with open(candidate, "rb") as f:
                return f.read()
    tried = " or ".join(repr(os.path.abspath(c)) for c in candidates)
    raise DataError(
        f"{where}: image {_shown(ref)} not found (looked for {tried}); image paths are absolute, relative "
        "to the working directory or to the data file's folder."
    )


def _url(url: str, where: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT_S) as response:
            return response.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DataError(
            f"{where}: image URL {url!r} could not be read within {URL_TIMEOUT_S:.0f} s ({exc}); "
            "download the images and give local paths."
        ) from exc


def _base64(uri: str, where: str) -> bytes:
    _, _, payload = uri.partition("base64,")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise DataError(
            f"{where}: image {_shown(uri)} is a data URI whose base64 payload does not decode ({exc})."
        ) from exc


def load_image(ref: Any, where: str, base_dir: str | None = None) -> Any:
    """`ref` (any form above) -> an RGB PIL image. `where` names the record in errors; `base_dir`: the data file's
    folder, tried for relative paths after the working directory."""
    from PIL import Image  # noqa: PLC0415 - only VLM runs read images

    if isinstance(ref, Image.Image):
        image = ref
    elif isinstance(ref, Mapping):
        if ref.get("bytes") is not None:
            return load_image(bytes(ref["bytes"]), where, base_dir)
        inner = next((ref[k] for k in ("path", "image", "image_url", "url") if ref.get(k) is not None), None)
        if isinstance(inner, Mapping) and "url" in inner:  # OpenAI's {"image_url": {"url": ...}}
            inner = inner["url"]
        if inner is None:
            raise DataError(
                f"{where}: image {_shown(ref)} has none of the keys 'bytes', 'path', 'image', "
                "'image_url', 'url'; give one of them."
            )
        return load_image(inner, where, base_dir)
    elif isinstance(ref, (bytes, bytearray)):
        image = _decoded(bytes(ref), where, ref)
    elif isinstance(ref, str):
        if ref.startswith(_DATA_URI):
            data = _base64(ref, where)
        elif ref.startswith(("http://", "https://")):
            data = _url(ref, where)
        else:
            data = _local(ref.removeprefix("file://"), base_dir, where, ref)
        image = _decoded(data, where, ref)
    elif hasattr(ref, "__array_interface__") or hasattr(ref, "__array__"):
        array = np.asarray(ref)
        try:
            image = Image.fromarray(array.astype(np.uint8) if array.dtype != np.uint8 else array)
        except (TypeError, ValueError) as exc:
            raise DataError(
                f"{where}: image array of shape {array.shape} and dtype {array.dtype} is not an image "
                f"([H, W], [H, W, 3] or [H, W, 4] values 0-255): {exc}"
            ) from exc
    else:
        raise DataError(
            f"{where}: image {_shown(ref)} ({type(ref).__name__}) is not a path, URL, data URI, bytes, "
            "{'bytes'/'path'} mapping, PIL image or array."
        )
    return image.convert("RGB") if image.mode != "RGB" else image
