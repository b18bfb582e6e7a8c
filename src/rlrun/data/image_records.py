"""Where a prompt record keeps its images, in the two layouts users bring:

- OpenRLHF-M / OpenRLHF's VLM datasets: a chat whose message `content` is a list mixing
  `{"type": "image", "image": <path, URL, data URI, ...>}` and `{"type": "text", "text": ...}` entries;
- verl (and Search-R1-style preprocessing): an `images` column (`data.image_key`) of images in order, and `<image>`
  placeholders in the prompt's text that say where each goes.

Both become one form: a chat whose image entries are `{"type": "image"}` (what chat templates render as the model's
image tokens) and the images' references in order, loaded later (rlrun.data.images) on the ranks that generate.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rlrun.runtime.errors import DataError

IMAGE_PLACEHOLDER = "<image>"
_PLACEHOLDER_SPLIT = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)})")
Messages = list[dict[str, Any]]


def is_image_entry(part: Any) -> bool:
    return isinstance(part, Mapping) and (part.get("type") in ("image", "image_url") or "image" in part
                                          or "image_url" in part)


def _image_ref(part: Mapping[str, Any]) -> Any:
    for key in ("image", "image_url", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    return None


def _with_placeholders(text: str) -> list[dict[str, Any]]:
    parts = [s for s in _PLACEHOLDER_SPLIT.split(text) if s]
    return [{"type": "image"} if s == IMAGE_PLACEHOLDER else {"type": "text", "text": s} for s in parts]


def images_of(prompt: str | Messages, column: Any, where: str, image_key: str) -> tuple[str | Messages, tuple[Any, ...]]:
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
            raise DataError(f"{where} has {placeholders} image entries without an image (no 'image' value) besides "
                            f"{len(inline)} with one; give every image entry its image.")
        return messages, tuple(inline)
    if placeholders != len(listed):
        hint = (f" Put one {IMAGE_PLACEHOLDER!r} in the prompt text per image (verl's convention), or image entries "
                'in the message content ({"type": "image", "image": ...}).')
        raise DataError(f"{where} has {len(listed)} images in {image_key!r} but its prompt shows {placeholders} "
                        f"image places.{hint}")
    return messages, tuple(listed)
