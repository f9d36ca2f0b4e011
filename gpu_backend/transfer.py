"""The KV transfer between a prefill node and a decode node: pages + manifest, never pickle.

Wire format (docs/design.md, invariant 5): one safetensors file holding a single tensor ``kv`` of shape
``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]`` (the layout of
``Engine.prefill_export``), with the manifest as JSON text in the safetensors metadata under
:data:`MANIFEST_KEY`. The manifest carries the bootstrap room, the request id, ``num_tokens``
(tokens actually written by prefill), ``prompt_ids_sha256`` (:func:`prompt_ids_sha256` of the token
ids prefill's forward pass ran over, so decode can tell pages of another prompt of the same length
from its room's: invariant 2), the page geometry, one BLAKE2b-128 checksum per page, and what
prefill learnt (first token id, prefill seconds, whether the prompt was a rejection placeholder).
A manifest without a well-formed digest is refused like any other malformed one.

:func:`decode_transfer` parses the safetensors header itself (8-byte little-endian length + JSON)
and checks every field before ``safetensors.torch.load`` touches the data, so a pickle (or any
other) payload is rejected as malformed: nothing received over the network is ever unpickled.
Pages holding a NaN or infinity are refused too (:func:`verify_pages`).
In-process transfer (``--role all``) hands the same :class:`Manifest` and tensor across without
serialising; decode verifies both paths alike (:func:`verify_pages`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from config.errors import ErrorCode

MANIFEST_KEY = "kvgate.manifest"
WIRE_VERSION = 1
CONTENT_TYPE = "application/x-kvgate-kv+safetensors"
#: Largest safetensors header accepted (bytes); a real one is a few hundred.
MAX_HEADER_BYTES = 64 * 1024
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
#: A SHA-256 digest as :func:`prompt_ids_sha256` writes it.
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def prompt_ids_sha256(prompt_ids: Sequence[int]) -> str:
    """SHA-256 (lowercase hex) of the token ids, each as 8 little-endian bytes (signed int64): the
    prompt a transfer's pages hold. Raises ``struct.error`` for an id that is not an int64."""
    return hashlib.sha256(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids)).hexdigest()


class TransferFormatError(ValueError):
    """The payload is not a well-formed kvgate transfer (wrong container, header, manifest, shape
    or checksum). ``status`` is the HTTP status the decode node answers (400)."""

    status = 400
    code = ErrorCode.INVALID_TRANSFER


@dataclass
class Manifest:
    """What travels with the pages.

    ``room``: bootstrap room (63-bit int). ``request_id``: the router's id. ``num_tokens``: prompt
    positions prefill wrote (1 for a rejection placeholder). ``num_pages`` = ceil(num_tokens /
    page_size). ``shape``/``dtype``: of the ``kv`` tensor. ``checksums``: BLAKE2b-128 hex digest of
    each page's bytes. ``first_token_id``: the token prefill sampled. ``prompt_ids_sha256``:
    :func:`prompt_ids_sha256` of the ids prefill's forward pass ran over (the placeholder's for a
    placeholder), which decode compares with its room's prompt. ``prefill_seconds``: prefill
    forward time. ``placeholder``: the prompt was replaced by a one-token placeholder (fault
    ``admit_rejected``). ``original_prompt_tokens``: the prompt's own length.
    """

    room: int
    request_id: str
    num_tokens: int
    num_pages: int
    page_size: int
    dtype: str
    shape: list[int]
    checksums: list[str]
    first_token_id: int
    prompt_ids_sha256: str
    prefill_seconds: float = 0.0
    placeholder: bool = False
    original_prompt_tokens: int = 0
    version: int = WIRE_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """The manifest as compact JSON text."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse and type-check a manifest; raises :class:`TransferFormatError`."""
        raw = _json_object(text)
        _check_scalars(raw)
        _check_lists(raw)
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise TransferFormatError(f"manifest has unknown field(s): {', '.join(unknown)}")
        m = cls(**{**raw, "prefill_seconds": float(raw["prefill_seconds"])})
        m.check_geometry()
        return m

    def check_geometry(self) -> None:
        """Internal consistency: pages = ceil(tokens / page_size), one checksum per page, shape
        ``[num_pages, L, 2, page_size, H, D]``, a prompt digest. Raises :class:`TransferFormatError`."""
        if self.room < 0 or self.num_tokens < 1 or self.page_size < 1:
            raise TransferFormatError("manifest needs room >= 0, num_tokens >= 1, page_size >= 1")
        if self.num_pages != math.ceil(self.num_tokens / self.page_size):
            raise TransferFormatError(
                f"manifest says {self.num_pages} pages for {self.num_tokens} tokens of page size {self.page_size}"
            )
        if (
            len(self.shape) != 6
            or self.shape[0] != self.num_pages
            or self.shape[2] != 2
            or self.shape[3] != self.page_size
        ):
            raise TransferFormatError(
                f"manifest shape {self.shape} is not [num_pages, layers, 2, page_size, heads, dim]"
            )
        if len(self.checksums) != self.num_pages:
            raise TransferFormatError(f"manifest has {len(self.checksums)} checksums for {self.num_pages} pages")
        if self.dtype not in _DTYPES:
            raise TransferFormatError(f"manifest dtype {self.dtype!r} is not one of {', '.join(_DTYPES)}")
        if not isinstance(self.prompt_ids_sha256, str) or not _SHA256_HEX.fullmatch(self.prompt_ids_sha256):
            raise TransferFormatError(_NO_DIGEST)


_NO_DIGEST = "manifest field 'prompt_ids_sha256' must be a SHA-256 hex digest (64 lowercase hex digits)"
_INT_FIELDS = ("room", "num_tokens", "num_pages", "page_size", "first_token_id", "original_prompt_tokens", "version")


def _json_object(text: str) -> dict[str, Any]:
    try:
        raw = json.loads(text)
    except (TypeError, ValueError) as e:
        raise TransferFormatError(f"manifest is not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise TransferFormatError("manifest must be a JSON object")
    return raw


def _check_scalars(raw: dict[str, Any]) -> None:
    """The manifest's integer, version, string, number and bool fields."""
    for k in _INT_FIELDS:
        if not isinstance(raw.get(k), int) or isinstance(raw.get(k), bool):
            raise TransferFormatError(f"manifest field '{k}' must be an integer")
    if raw["version"] != WIRE_VERSION:
        raise TransferFormatError(f"manifest version {raw['version']} is not {WIRE_VERSION}")
    if not isinstance(raw.get("request_id"), str) or not isinstance(raw.get("dtype"), str):
        raise TransferFormatError("manifest fields 'request_id' and 'dtype' must be strings")
    if not isinstance(raw.get("prefill_seconds"), (int, float)) or not isinstance(raw.get("placeholder"), bool):
        raise TransferFormatError("manifest fields 'prefill_seconds' (number) and 'placeholder' (bool) are wrong")
    if not isinstance(raw.get("prompt_ids_sha256"), str):
        raise TransferFormatError(_NO_DIGEST)


def _check_lists(raw: dict[str, Any]) -> None:
    """The manifest's ``shape``, ``checksums`` and ``extra`` fields."""
    shape, sums = raw.get("shape"), raw.get("checksums")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise TransferFormatError("manifest field 'shape' must be a list of non-negative integers")
    if not isinstance(sums, list) or not all(isinstance(s, str) for s in sums):
        raise TransferFormatError("manifest field 'checksums' must be a list of hex strings")
    if not isinstance(raw.get("extra", {}), dict):
        raise TransferFormatError("manifest field 'extra' must be an object")


def page_checksums(kv: torch.Tensor) -> list[str]:
    """BLAKE2b-128 hex digest of each page's raw bytes (``kv`` shaped ``[num_pages, ...]``)."""
    flat = kv.detach().contiguous().reshape(kv.shape[0], -1).view(torch.uint8).numpy()
    return [hashlib.blake2b(flat[i].data, digest_size=16).hexdigest() for i in range(flat.shape[0])]


def build_manifest(
    *,
    room: int,
    request_id: str,
    kv: torch.Tensor,
    num_tokens: int,
    first_token_id: int,
    prompt_ids: Sequence[int],
    prefill_seconds: float = 0.0,
    placeholder: bool = False,
    original_prompt_tokens: int | None = None,
) -> Manifest:
    """The manifest for ``kv`` (``[num_pages, L, 2, page_size, H, D]``, CPU) with checksums computed.
    ``prompt_ids``: the token ids the forward pass that wrote ``kv`` ran over (digested into
    ``prompt_ids_sha256``). Raises :class:`TransferFormatError` when ``kv`` and ``num_tokens``
    disagree, or for an id that is not an int64."""
    try:
        digest = prompt_ids_sha256(prompt_ids)
    except struct.error as e:
        raise TransferFormatError(f"prompt ids are not int64 token ids: {e}") from None
    if kv.dtype not in _DTYPE_NAMES:
        raise TransferFormatError(f"unsupported KV dtype {kv.dtype}")
    m = Manifest(
        room=room,
        request_id=request_id,
        num_tokens=num_tokens,
        num_pages=int(kv.shape[0]),
        page_size=int(kv.shape[3]) if kv.dim() == 6 else 0,
        dtype=_DTYPE_NAMES[kv.dtype],
        shape=[int(d) for d in kv.shape],
        checksums=page_checksums(kv),
        first_token_id=first_token_id,
        prompt_ids_sha256=digest,
        prefill_seconds=float(prefill_seconds),
        placeholder=placeholder,
        original_prompt_tokens=num_tokens if original_prompt_tokens is None else original_prompt_tokens,
    )
    m.check_geometry()
    return m


def verify_pages(manifest: Manifest, kv: torch.Tensor) -> None:
    """Check that ``kv`` is exactly what ``manifest`` describes (shape, dtype, every page's
    checksum) and holds only finite values: a NaN or infinity in one request's pages would make
    its sampling raise and fail every request of the decode batch it joins. Raises
    :class:`TransferFormatError` naming the first mismatch or page."""
    manifest.check_geometry()
    if [int(d) for d in kv.shape] != manifest.shape:
        raise TransferFormatError(f"pages have shape {list(kv.shape)}, manifest says {manifest.shape}")
    if _DTYPE_NAMES.get(kv.dtype) != manifest.dtype:
        raise TransferFormatError(f"pages have dtype {kv.dtype}, manifest says {manifest.dtype}")
    for i, (got, want) in enumerate(zip(page_checksums(kv), manifest.checksums, strict=True)):
        if got != want:
            raise TransferFormatError(f"page {i} checksum {got} does not match the manifest's {want}")
    bad = (~torch.isfinite(kv)).reshape(kv.shape[0], -1).any(dim=1).nonzero()
    if bad.numel():
        raise TransferFormatError(f"page {int(bad[0])} holds a value that is not finite (NaN or infinity)")


def encode_transfer(manifest: Manifest, kv: torch.Tensor) -> bytes:
    """Serialise pages + manifest as one safetensors payload (bytes)."""
    return st_save({"kv": kv.detach().contiguous()}, metadata={MANIFEST_KEY: manifest.to_json()})


def _read_header(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    if len(data) < 8:
        raise TransferFormatError("payload is shorter than a safetensors header")
    n = int.from_bytes(bytes(data[:8]), "little")
    if n < 2 or n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise TransferFormatError(
            "payload is not a safetensors file (bad header length); pickle and other formats are refused"
        )
    try:
        header = json.loads(bytes(data[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise TransferFormatError(f"safetensors header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise TransferFormatError("safetensors header must be a JSON object")
    return header, n


def decode_transfer(data: bytes | bytearray | memoryview) -> tuple[Manifest, torch.Tensor]:
    """Parse a transfer payload into ``(manifest, kv)``, verifying container, manifest, shape, dtype
    and every page checksum. Never unpickles. Raises :class:`TransferFormatError`."""
    header, n = _read_header(data)
    if set(header) != {"kv", "__metadata__"}:
        raise TransferFormatError(f"payload must hold exactly the tensor 'kv' and metadata; got {sorted(header)}")
    meta, info = header["__metadata__"], header["kv"]
    if not isinstance(meta, dict) or not isinstance(meta.get(MANIFEST_KEY), str):
        raise TransferFormatError(f"payload metadata has no '{MANIFEST_KEY}'")
    if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
        raise TransferFormatError("tensor 'kv' has an unsupported dtype")
    offsets = info.get("data_offsets")
    if offsets != [0, len(data) - 8 - n]:
        raise TransferFormatError("tensor 'kv' does not span the payload's data exactly")
    manifest = Manifest.from_json(meta[MANIFEST_KEY])
    if info.get("shape") != manifest.shape or info["dtype"] != manifest.dtype:
        raise TransferFormatError("tensor 'kv' shape/dtype differ from the manifest")
    try:
        kv = st_load(bytes(data))["kv"]
    except Exception as e:  # safetensors raises its own error type for a corrupt payload
        raise TransferFormatError(f"safetensors payload is corrupt: {e}") from e
    verify_pages(manifest, kv)
    return manifest, kv
