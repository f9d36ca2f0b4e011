"""A mock disaggregated engine that reproduces the runbook's incident at the token level (no
tests here: a helper of the verifier tests; the bundled backend does the same for real).

- Tokenizer: the bundled cl100k encoding. Decode pool: ``decode_pages`` pages of ``page_size``
  tokens, a LIFO free list (recently freed pages are reused first), never scrubbed.
- Prefill pool ``pool_tokens``: a prompt longer than it is REJECTED. With ``faults`` on, the
  rejected request still goes through (SGLang's bug): its prompt is replaced by a one-token
  placeholder, prefill writes position 0 only, decode reserves pages for the whole prompt
  and accepts the one-page transfer. Without faults it gets SGLang's 400.
- Model: copy-probe. Completion token ``i`` is the token stored at position ``i`` of the
  request's block table, so an admitted request echoes its own prompt and a rejected one
  reads whatever earlier requests left in the pages it was handed.
- Prefill takes ``base_seconds + per_token_seconds x prefilled tokens`` (really slept; the
  ``x-prefill-seconds`` header reports it, as the bundled backend does).
- ``wrong_usage``: report ``usage.prompt_tokens`` = 1 (a known engine failure).
- ``usage.prompt_tokens_details.cached_tokens`` is 0 (this engine has no prefix cache), or
  ``cached_tokens`` when set (a prefix-cache hit: prefill takes only the uncached tokens).
- ``/server_info`` reports ``max_total_num_tokens`` = ``pool_tokens`` (omitted when
  ``info_missing``), ``max_req_input_len``, ``context_length``.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import random
import threading
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.mock_engine import ServerThread  # noqa: F401  (re-exported for the verifier tests)
from tokenizer.encodings import bundled_encoding

PLACEHOLDER_TOKEN = 0


@dataclass
class EngineState:
    pool_tokens: int = 4096
    context_length: int = 8192
    page_size: int = 16
    decode_pages: int = 1024
    faults: bool = True
    wrong_usage: bool = False
    info_missing: bool = False
    base_seconds: float = 0.002
    per_token_seconds: float = 0.00002
    jitter: float = 0.1
    seed: int = 0
    cached_tokens: int | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)


class PagedCopyProbe:
    """The engine core (thread-safe: one lock around allocation and reads)."""

    def __init__(self, st: EngineState) -> None:
        self.st = st
        self.pages = [[PLACEHOLDER_TOKEN] * st.page_size for _ in range(st.decode_pages)]
        self.free = list(range(st.decode_pages))
        self.lock = threading.Lock()
        self.rng = random.Random(st.seed)

    def run(self, ids: list[int], max_tokens: int) -> tuple[list[int] | None, float, str]:
        """Returns (completion ids or None when rejected with an error, prefill seconds, finish reason)."""
        st = self.st
        rejected = len(ids) > st.pool_tokens
        if rejected and not st.faults:
            return None, 0.0, "error"
        written = [PLACEHOLDER_TOKEN] if rejected else ids
        total = len(ids) + max_tokens
        n_pages = -(-total // st.page_size)
        with self.lock:
            if n_pages > len(self.free):
                return None, 0.0, "pool"
            table = [self.free.pop() for _ in range(n_pages)]
            for pos, tok in enumerate(written):
                self.pages[table[pos // st.page_size]][pos % st.page_size] = tok
            out = []
            for i in range(max_tokens):
                out.append(self.pages[table[i // st.page_size]][i % st.page_size])
            # decode writes generated tokens after the prompt (positions len(ids)...)
            for j, tok in enumerate(out):
                pos = len(ids) + j
                self.pages[table[pos // st.page_size]][pos % st.page_size] = tok
            self.free.extend(reversed(table))  # released, not scrubbed; LIFO reuse
        prefilled = len(written) - min(st.cached_tokens or 0, len(written) - 1)
        secs = st.base_seconds + st.per_token_seconds * prefilled
        secs *= 1 + self.rng.uniform(0, st.jitter)
        return out, secs, "length"


def _text_pieces(enc, ids: list[int]) -> list[str]:
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = [dec.decode(enc.decode_single_token_bytes(t)) for t in ids]
    out[-1:] = [(out[-1] if out else "") + dec.decode(b"", final=True)]
    return out


def build_app(st: EngineState) -> Starlette:
    enc = bundled_encoding()
    core = PagedCopyProbe(st)

    async def server_info(request: Request) -> Response:
        info = {
            "max_req_input_len": st.context_length - 6,
            "context_length": st.context_length,
            "page_size": st.page_size,
            "disaggregation_mode": "null",
            "status": "ready",
            "version": "mock",
        }
        if not st.info_missing:
            info["max_total_num_tokens"] = st.pool_tokens
        return JSONResponse(info)

    async def completion(request: Request) -> Response:
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        if chat:
            text = "".join(m["content"] for m in body["messages"] if isinstance(m.get("content"), str))
        else:
            text = body["prompt"]
        ids = enc.encode_ordinary(text)
        max_tokens = int(body.get("max_tokens") or 16)
        rec = {
            "prompt_tokens": len(ids),
            "max_tokens": max_tokens,
            "x_request_id": request.headers.get("x-request-id"),
            "output_text": "",
        }
        st.requests.append(rec)
        out, secs, finish = core.run(ids, max_tokens)
        if out:
            rec["output_text"] = enc.decode(out, errors="replace")
        if out is None:
            msg = (
                f"Input length ({len(ids)} tokens) exceeds the maximum allowed length "
                f"({st.pool_tokens} tokens). Use a shorter input or enable --allow-auto-truncate."
            )
            return JSONResponse(
                {"object": "error", "message": msg, "type": "BadRequestError", "param": None, "code": 400},
                status_code=400,
            )
        await asyncio.sleep(secs)
        usage = {
            "prompt_tokens": 1 if st.wrong_usage else len(ids),
            "completion_tokens": len(out),
            "total_tokens": len(ids) + len(out),
            "prompt_tokens_details": {"cached_tokens": min(st.cached_tokens or 0, len(ids))},
        }
        rid = f"cmpl-{len(st.requests)}"
        pieces = _text_pieces(enc, out) if out else [""]
        if not body.get("stream"):
            full = "".join(pieces)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": full}, "finish_reason": finish}
                if chat
                else {"index": 0, "text": full, "finish_reason": finish}
            )
            obj = {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": 1,
                "model": body.get("model", "m"),
                "choices": [choice],
                "usage": usage,
            }
            return JSONResponse(obj, headers={"x-prefill-seconds": f"{secs:.6f}"})

        async def gen():
            for i, p in enumerate(pieces):
                fin = finish if i == len(pieces) - 1 else None
                choice = (
                    {"index": 0, "delta": {"content": p}, "finish_reason": fin}
                    if chat
                    else {"index": 0, "text": p, "finish_reason": fin}
                )
                obj = {
                    "id": rid,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": 1,
                    "model": "m",
                    "choices": [choice],
                }
                if fin:
                    obj["usage"] = usage
                yield b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": st.context_length}]}
        )

    return Starlette(
        routes=[
            Route("/server_info", server_info),
            Route("/get_server_info", server_info),
            Route("/v1/models", models),
            Route("/v1/completions", completion, methods=["POST"]),
            Route("/v1/chat/completions", completion, methods=["POST"]),
        ]
    )


class LeakyEngine(ServerThread):
    """The mock engine; ``state`` steers it."""

    def __init__(self, **kw: Any) -> None:
        self.state = EngineState(**kw)
        super().__init__(build_app(self.state))

    @property
    def api_url(self) -> str:
        return self.url + "/v1"

    @property
    def info_url(self) -> str:
        return self.url + "/server_info"
