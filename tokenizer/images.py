"""What an image content part costs in prompt tokens (config ``models[].images``, docs/gateway.md).

Three rules, chosen per model (:class:`config.models.ImagePolicy` ``cost``):

- ``fixed``: every image costs ``tokenizer.image_tokens`` (the operator sets it to at least the
  model's largest per-image cost, e.g. 576 for LLaVA-1.5 at 336 px, 2,880 for LLaVA-NeXT's 5 tiles);
- ``openai_tiles``: OpenAI's published formula for GPT-4o / GPT-4.1 class models: the image is
  fitted within 2048 x 2048, then scaled so its shortest side is 768 px (never enlarged), and costs
  ``base_tokens + tile_tokens x`` the number of 512-px tiles; ``detail: "low"`` costs ``base_tokens``;
- ``qwen2_vl``: Qwen2-VL / Qwen2.5-VL (patch 14, 2 x 2 merge): the image is resized as their
  processor's ``smart_resize`` does (sides rounded to multiples of 28, area kept within
  ``[min_pixels, max_pixels]``) and costs ``(h / 28) x (w / 28)`` tokens plus 2 (the
  ``<|vision_start|>``/``<|vision_end|>`` tokens the template puts around it).

An image's size is read from the first bytes of a ``data:`` URL (PNG, GIF, JPEG, WebP headers,
no decoding library). An image whose size cannot be read (a remote URL, an unknown format) costs
the rule's maximum, so the count is never below the engine's.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from typing import Any

from config.models import ImagePolicy

#: bytes of a data URL decoded to find the size (JPEG SOF markers can sit after large EXIF blocks)
HEADER_BYTES = 256 * 1024


def image_url_of(part: dict) -> str | None:
    """The URL of an image content part: chat ``{"type": "image_url", "image_url": {"url"}}`` or
    ``{"image_url": "..."}``, Responses-style ``{"type": "input_image", "image_url": "..."}``."""
    v = part.get("image_url")
    if isinstance(v, dict):
        v = v.get("url")
    return v if isinstance(v, str) else None


def detail_of(part: dict) -> str:
    """The part's ``detail`` (``low`` | ``high`` | ``auto``; default ``auto``)."""
    v = part.get("image_url")
    d = v.get("detail") if isinstance(v, dict) else part.get("detail")
    return d if isinstance(d, str) else "auto"


def _jpeg_size(b: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 9 < len(b):
        if b[i] != 0xFF:
            return None
        marker = b[i + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        (length,) = struct.unpack(">H", b[i + 2 : i + 4])
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            h, w = struct.unpack(">HH", b[i + 5 : i + 9])
            return w, h
        i += 2 + length
    return None


def image_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` in pixels from an image's first bytes (PNG, GIF, JPEG, WebP VP8/VP8L/
    VP8X), or ``None`` when the format is not one of these or the header is cut."""
    try:
        if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR":
            return struct.unpack(">II", data[16:24])
        if data[:6] in (b"GIF87a", b"GIF89a"):
            return struct.unpack("<HH", data[6:10])
        if data[:2] == b"\xff\xd8":
            return _jpeg_size(data)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            kind = data[12:16]
            if kind == b"VP8 ":
                w, h = struct.unpack("<HH", data[26:30])
                return w & 0x3FFF, h & 0x3FFF
            if kind == b"VP8L":
                bits = int.from_bytes(data[21:25], "little")
                return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
            if kind == b"VP8X":
                return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    except struct.error:
        return None
    return None


def data_url_size(url: str) -> tuple[int, int] | None:
    """The size of the image in a base64 ``data:`` URL, or ``None`` (not base64, not an image
    format :func:`image_size` reads)."""
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        return None
    for limit in (1024, HEADER_BYTES):  # PNG, GIF, WebP: the first bytes; JPEG may need more
        chunk = payload[: limit * 4 // 3]
        chunk = chunk[: len(chunk) - len(chunk) % 4]
        try:
            data = base64.b64decode(chunk, validate=False)
        except (binascii.Error, ValueError):
            return None
        size = image_size(data)
        if size is not None:
            return size if size[0] >= 1 and size[1] >= 1 else None
        if len(chunk) < limit * 4 // 3 - 3:
            return None  # the whole payload was read
    return None


def openai_tiles_tokens(width: int, height: int, base: int, per_tile: int) -> int:
    """OpenAI's high-detail cost: fit within 2048 x 2048, shortest side to 768 (never enlarged),
    then ``base + per_tile x ceil(w / 512) x ceil(h / 512)``."""
    w, h = float(width), float(height)
    if max(w, h) > 2048:
        s = 2048 / max(w, h)
        w, h = w * s, h * s
    if min(w, h) > 768:
        s = 768 / min(w, h)
        w, h = w * s, h * s
    return base + per_tile * math.ceil(w / 512) * math.ceil(h / 512)


def qwen2_vl_tokens(width: int, height: int, min_pixels: int, max_pixels: int, factor: int = 28) -> int:
    """Qwen2-VL's ``smart_resize`` (image_processing_qwen2_vl.py) then ``(h / 28) x (w / 28)``
    visual tokens, plus 2 for the vision start/end tokens. Extreme aspect ratios (> 200, which
    the processor refuses) cost the maximum."""
    if max(width, height) / min(width, height) > 200:
        return max_pixels // (factor * factor) + 2
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return (h // factor) * (w // factor) + 2


class ImageCoster:
    """``part -> tokens`` for one model: its :class:`~config.models.ImagePolicy` and its fixed
    ``image_tokens``. Never raises: a part whose size cannot be read costs :attr:`maximum`."""

    def __init__(self, policy: ImagePolicy, fixed_tokens: int) -> None:
        self.policy = policy
        self.fixed_tokens = fixed_tokens
        if policy.cost == "openai_tiles":
            # the largest image after the fit: 768 x 2048 -> 2 x 4 tiles
            self.maximum = policy.base_tokens + policy.tile_tokens * 8
        elif policy.cost == "qwen2_vl":
            self.maximum = policy.max_pixels // (28 * 28) + 2
        else:
            self.maximum = fixed_tokens

    def __call__(self, part: dict[str, Any]) -> int:
        p = self.policy
        if p.cost == "fixed":
            return self.fixed_tokens
        if p.cost == "openai_tiles" and detail_of(part) == "low":
            return p.base_tokens
        url = image_url_of(part)
        size = data_url_size(url) if url is not None and url.startswith("data:") else None
        if size is None:
            return self.maximum
        if p.cost == "openai_tiles":
            return openai_tiles_tokens(size[0], size[1], p.base_tokens, p.tile_tokens)
        return qwen2_vl_tokens(size[0], size[1], p.min_pixels, p.max_pixels)
