"""The KV transfer wire format (safetensors + JSON manifest + per-page checksums) and docs/design.md
invariant 5: network data is never unpickled."""

from __future__ import annotations

import ast
import os
import pickle
from pathlib import Path

import httpx
import pytest
import torch

from gpu_backend import transfer as T
from tests.conftest import ROOT

SHAPE = (3, 2, 2, 4, 1, 8)  # [num_pages, layers, 2, page_size, kv_heads, head_dim]


def _kv(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*SHAPE, generator=g)


def _manifest(kv: torch.Tensor, num_tokens: int = 10, **kw) -> T.Manifest:
    return T.build_manifest(
        room=12345,
        request_id="req-1",
        kv=kv,
        num_tokens=num_tokens,
        first_token_id=777,
        prefill_seconds=0.25,
        prompt_ids=list(range(num_tokens)),
        **kw,
    )


def test_round_trip_is_bit_exact_and_keeps_the_manifest():
    kv = _kv()
    m = _manifest(kv)
    payload = T.encode_transfer(m, kv)
    m2, kv2 = T.decode_transfer(payload)
    assert m2 == m
    assert m2.num_pages == 3 and m2.num_tokens == 10 and m2.page_size == 4 and m2.dtype == "F32"
    assert m2.shape == list(SHAPE) and len(m2.checksums) == 3 and all(len(c) == 32 for c in m2.checksums)
    assert torch.equal(kv2, kv)
    # the container is plain safetensors: its header starts with the 8-byte little-endian length
    n = int.from_bytes(payload[:8], "little")
    assert payload[8:9] == b"{" and n < 4096


def test_bfloat16_pages_round_trip():
    kv = _kv().to(torch.bfloat16)
    m = _manifest(kv)
    m2, kv2 = T.decode_transfer(T.encode_transfer(m, kv))
    assert m2.dtype == "BF16" and torch.equal(kv2, kv)


def test_a_flipped_byte_is_caught_by_its_page_checksum():
    kv = _kv()
    payload = bytearray(T.encode_transfer(_manifest(kv), kv))
    page_bytes = kv[0].numel() * 4
    payload[-page_bytes + 5] ^= 0x01  # a byte inside the last page (page 2)
    with pytest.raises(T.TransferFormatError, match="page 2 checksum"):
        T.decode_transfer(bytes(payload))


def test_manifest_must_match_the_pages():
    kv = _kv()
    with pytest.raises(T.TransferFormatError, match="3 pages for 20 tokens"):
        _manifest(kv, num_tokens=20)  # 20 tokens need 5 pages of 4
    m = _manifest(kv)
    with pytest.raises(T.TransferFormatError, match="shape"):
        T.verify_pages(m, kv[:2])
    m.checksums[1] = "0" * 32
    with pytest.raises(T.TransferFormatError, match="page 1 checksum"):
        T.verify_pages(m, kv)


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"", "shorter than a safetensors header"),
        (b"\xff" * 16, "bad header length"),
        ((5).to_bytes(8, "little") + b"[1,2]", "must be a JSON object"),
        ((2).to_bytes(8, "little") + b"{}", "exactly the tensor 'kv'"),
    ],
)
def test_malformed_containers_are_refused(payload, message):
    with pytest.raises(T.TransferFormatError, match=message):
        T.decode_transfer(payload)


def test_extra_tensors_or_unknown_manifest_fields_are_refused():
    from safetensors.torch import save

    kv = _kv()
    m = _manifest(kv)
    two = save({"kv": kv, "other": kv.clone()}, metadata={T.MANIFEST_KEY: m.to_json()})
    with pytest.raises(T.TransferFormatError, match="exactly the tensor 'kv'"):
        T.decode_transfer(two)
    raw = m.to_json().replace('"version":1', '"version":1,"evil":"x"')
    with pytest.raises(T.TransferFormatError, match="unknown field"):
        T.decode_transfer(save({"kv": kv}, metadata={T.MANIFEST_KEY: raw}))


class _Bomb:
    """Unpickling this creates a directory: the observable side effect of pickle executing code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _pickle_payload(marker: Path) -> bytes:
    return pickle.dumps({"kv": _Bomb(str(marker)), "manifest": {"room": 1}})


def test_invariant_5_a_pickle_payload_is_rejected_and_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    payload = _pickle_payload(marker)
    with pytest.raises(T.TransferFormatError, match="pickle and other formats are refused"):
        T.decode_transfer(payload)
    assert not marker.exists()
    # the payload is live: pickle itself WOULD run it (so the assertion above can fail)
    probe = tmp_path / "probe"
    pickle.loads(_pickle_payload(probe))
    assert probe.is_dir()


def test_invariant_5_decode_node_refuses_pickle_over_http(tmp_path):
    """POST a pickle to a real decode node's /disagg/transfer: 415 for a pickle content type, 400 when
    it claims to be a transfer, the side effect never happens, and no room is touched."""
    from gpu_backend.decode_node import DecodeNode
    from gpu_backend.engine import Engine, EngineConfig
    from gpu_backend.servers import build_decode_app

    engine = Engine(EngineConfig(model="copy-probe", device="cpu", context_length=256, max_total_tokens=256))
    node = DecodeNode(engine)
    app = build_decode_app(node)
    marker = tmp_path / "unpickled"
    payload = _pickle_payload(marker)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://decode") as c:
            r1 = await c.post(
                "/disagg/transfer", content=payload, headers={"content-type": "application/python-pickle"}
            )
            r2 = await c.post("/disagg/transfer", content=payload, headers={"content-type": T.CONTENT_TYPE})
            return r1, r2

    import asyncio

    r1, r2 = asyncio.run(go())
    assert r1.status_code == 415
    assert r1.json() == {
        "error": {
            "message": f"A transfer must be '{T.CONTENT_TYPE}' (safetensors + manifest); got 'application/python-pickle'.",
            "type": "invalid_request_error",
            "param": None,
            "code": "unsupported_media_type",
        }
    }
    assert r2.status_code == 400
    assert r2.json()["error"]["code"] == "invalid_transfer"
    assert "pickle and other formats are refused" in r2.json()["error"]["message"]
    assert not marker.exists()
    assert node.counters["transfers_accepted"] == 0 and len(node.rooms) == 0
    assert engine.pool_stats()["free_pages"] == engine.pool_stats()["total_pages"]


def test_invariant_5_no_backend_module_can_unpickle():
    """Static guard: nothing in gpu_backend imports pickle-based loaders (pickle, torch.load,
    numpy.load with allow_pickle, marshal, shelve)."""
    banned_modules = {"pickle", "cPickle", "dill", "marshal", "shelve", "joblib", "cloudpickle"}
    offenders = []
    for path in sorted((ROOT / "gpu_backend").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                offenders += [
                    f"{path.name}: import {a.name}" for a in node.names if a.name.split(".")[0] in banned_modules
                ]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in banned_modules:
                offenders.append(f"{path.name}: from {node.module}")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr == "load"
                and isinstance(node.value, ast.Name)
                and node.value.id in ("torch", "np", "numpy")
            ):
                offenders.append(f"{path.name}:{node.lineno}: {node.value.id}.load")
            elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                offenders.append(f"{path.name}:{node.lineno}: allow_pickle")
    assert offenders == []
