"""The isolation oracle's workload (copy-probe through the router's HTTP API). Test helper.

Each tenant owns a disjoint range of "clean" token ids (each decodes alone to valid UTF-8, none a
special token), so any completion token names the tenant whose prompt it came from. With copy-probe
and isolation intact, completion token j of a prompt p equals ``p[j % len(p)]``: a request's tokens
come only from its own prompt. Requests mix ``/generate`` (ids exact) and ``/v1/completions``
(text compared with the decoded expectation), streamed or not; some are aborted with
``/abort_request``, some streams are dropped by the client after their first chunk, some requests
are cancelled by the client before an answer (disconnect during prefill).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from config.errors import context_length_message
from tokenizer import bundled_counter

COUNTER = bundled_counter()
TENANT_RANGE = 5500
FIRST_ID = 1000


def tenant_pools(n_tenants: int) -> list[list[int]]:
    """Disjoint clean token ids per tenant: tenant t draws from [1000 + 5500 t, 1000 + 5500 (t + 1))."""
    enc = COUNTER.encoding
    pools = []
    for t in range(n_tenants):
        ids = []
        for i in range(FIRST_ID + TENANT_RANGE * t, FIRST_ID + TENANT_RANGE * (t + 1)):
            try:
                enc.decode_single_token_bytes(i).decode("utf-8")
            except (KeyError, UnicodeDecodeError):
                continue
            ids.append(i)
        pools.append(ids)
    return pools


def tenant_of(token_id: int) -> int | None:
    """The tenant whose range holds ``token_id`` (None outside every range)."""
    if token_id < FIRST_ID:
        return None
    return (token_id - FIRST_ID) // TENANT_RANGE


@dataclass
class Req:
    """One request: ``kind`` gen | gen_stream | cmpl | cmpl_stream; ``action`` none | abort
    (``/abort_request`` after the first chunk) | drop (client closes the stream after the first
    chunk) | cancel (client gives up after ``cancel_after`` seconds)."""

    idx: int
    tenant: int
    prompt: list[int]
    max_tokens: int
    kind: str
    action: str = "none"
    cancel_after: float = 0.0
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)

    def expected(self, n: int) -> list[int]:
        """What copy-probe must answer for the first ``n`` completion tokens."""
        return [self.prompt[j % len(self.prompt)] for j in range(n)]


@dataclass
class Result:
    req: Req
    status: int | None = None
    body: Any = None
    out_ids: list[int] | None = None
    text: str | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    cancelled: bool = False


def make_workload(
    *,
    n: int,
    n_tenants: int,
    max_req_input_len: int,
    pool_tokens: int,
    context_length: int,
    seed: int = 0,
    actions: bool = True,
) -> list[Req]:
    """``n`` requests from ``n_tenants`` tenants: lengths 1 .. 2 x pool (exactly
    ``max_req_input_len`` and one over it included for every tenant), ``max_tokens`` <= 32."""
    rng = random.Random(seed)
    pools = tenant_pools(n_tenants)
    L = max_req_input_len
    fixed = [1, L, L + 1, 2 * pool_tokens]
    reqs: list[Req] = []
    for i in range(n):
        t = i % n_tenants
        if i < len(fixed) * n_tenants:
            length = fixed[i // n_tenants]
        else:
            u = rng.random()
            if u < 0.50:
                length = rng.randint(1, min(32, L))
            elif u < 0.75:
                length = rng.randint(1, min(256, L))
            elif u < 0.87:
                length = rng.randint(1, L)
            else:
                length = rng.randint(L + 1, 2 * pool_tokens)
        over = length > L
        max_tokens = 32 if over else (rng.randint(1, 8) if rng.random() < 0.7 else rng.randint(9, 32))
        kind = rng.choices(["gen", "gen_stream", "cmpl", "cmpl_stream"], [0.45, 0.2, 0.2, 0.15])[0]
        action = "none"
        if actions and not over:
            v = rng.random()
            if v < 0.05:
                kind, action = "gen_stream", "abort"
            elif v < 0.10:
                kind, action = rng.choice(["gen_stream", "cmpl_stream"]), "drop"
            elif v < 0.13:
                action = "cancel"
        prompt = [rng.choice(pools[t]) for _ in range(length)]
        reqs.append(Req(i, t, prompt, max_tokens, kind, action, cancel_after=rng.uniform(0.001, 0.05)))
    rng.shuffle(reqs)
    return reqs


def _sse_events(buf: bytearray) -> list[bytes]:
    out = []
    while True:
        k = buf.find(b"\n\n")
        if k < 0:
            return out
        ev, rest = bytes(buf[:k]), buf[k + 2 :]
        buf[:] = rest
        assert ev.startswith(b"data: "), ev
        out.append(ev[6:])


async def _one(client: httpx.AsyncClient, req: Req) -> Result:
    res = Result(req)
    stream = req.kind.endswith("_stream")
    if req.kind.startswith("gen"):
        path, body = (
            "/generate",
            {
                "input_ids": req.prompt,
                "rid": req.rid,
                "stream": stream,
                "sampling_params": {"max_new_tokens": req.max_tokens, "temperature": 0},
            },
        )
    else:
        path, body = (
            "/v1/completions",
            {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "stream": stream},
        )
        if stream:
            body["stream_options"] = {"include_usage": True}
    content = orjson.dumps(body)
    headers = {"content-type": "application/json"}
    if not stream:
        call = client.post(path, content=content, headers=headers)
        if req.action == "cancel":
            try:
                r = await asyncio.wait_for(call, req.cancel_after)
            except asyncio.TimeoutError:
                res.cancelled = True
                return res
        else:
            r = await call
        res.status, res.body = r.status_code, r.json()
        if r.status_code == 200:
            if req.kind == "gen":
                res.out_ids, res.text = res.body["output_ids"], res.body["text"]
                mi = res.body["meta_info"]
                res.completion_tokens, res.prompt_tokens = mi["completion_tokens"], mi["prompt_tokens"]
                res.finish_reason = mi["finish_reason"]["type"]
            else:
                res.text = res.body["choices"][0]["text"]
                res.finish_reason = res.body["choices"][0]["finish_reason"]
                res.completion_tokens = res.body["usage"]["completion_tokens"]
                res.prompt_tokens = res.body["usage"]["prompt_tokens"]
        return res
    async with client.stream("POST", path, content=content, headers=headers) as r:
        res.status = r.status_code
        if r.status_code != 200:
            res.body = orjson.loads(await r.aread())
            return res
        buf, texts, first = bytearray(), [], True
        async for data in r.aiter_bytes():
            buf += data
            for ev in _sse_events(buf):
                if ev == b"[DONE]":
                    continue
                obj = orjson.loads(ev)
                if "error" in obj:
                    res.body = obj
                    res.status = -1  # error inside a 200 stream
                    continue
                if req.kind == "gen_stream":
                    res.out_ids, res.text = obj["output_ids"], obj["text"]
                    res.completion_tokens = obj["meta_info"]["completion_tokens"]
                    res.prompt_tokens = obj["meta_info"]["prompt_tokens"]
                    fr = obj["meta_info"]["finish_reason"]
                    res.finish_reason = fr["type"] if fr else None
                else:
                    if obj["choices"]:
                        texts.append(obj["choices"][0]["text"])
                        res.finish_reason = obj["choices"][0]["finish_reason"] or res.finish_reason
                    if obj.get("usage"):
                        res.completion_tokens = obj["usage"]["completion_tokens"]
                        res.prompt_tokens = obj["usage"]["prompt_tokens"]
                    res.text = "".join(texts)
                if first and req.action == "abort":
                    first = False
                    await client.post("/abort_request", json={"rid": req.rid})
                elif first and req.action == "drop":
                    res.cancelled = True
                    return res  # leaving the block closes the connection mid-stream
                first = False
    return res


async def run_workload(url: str, reqs: list[Req], concurrency: int = 32, timeout: float = 120.0) -> list[Result]:
    """Send ``reqs`` with at most ``concurrency`` in flight; results in ``reqs`` order."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2 + 8, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def guarded(r: Req) -> Result:
            async with sem:
                return await _one(client, r)

        return await asyncio.gather(*(guarded(r) for r in reqs))


def over_length_body(req: Req, max_req_input_len: int, context_length: int) -> dict:
    """The exact 400 an over-length request must get: the router's context check when prompt +
    max_tokens exceeds the context window, else prefill's admission rejection."""
    n = len(req.prompt)
    if n + req.max_tokens > context_length:
        msg = context_length_message(context_length, n, req.max_tokens, messages=False)
    else:
        msg = context_length_message(max_req_input_len, n, 0, messages=False)
    return {
        "error": {"message": msg, "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}
    }


def own_tokens_ok(res: Result) -> bool:
    """Whether the tokens (ids, or text for /v1/completions) received are exactly the own prompt's."""
    req = res.req
    if res.out_ids is not None:
        return res.out_ids == req.expected(len(res.out_ids))
    if res.text is None:
        return True
    if res.completion_tokens is not None and res.finish_reason is not None:
        return res.text == COUNTER.decode(req.expected(res.completion_tokens))
    exp = COUNTER.decode(req.expected(req.max_tokens))
    return exp.startswith(res.text)


def foreign_tenants(res: Result) -> set[int]:
    """Tenants other than the request's own whose tokens appear in the response (ids or text)."""
    req = res.req
    if res.out_ids is not None:
        ids = res.out_ids
    elif res.text:
        ids = COUNTER.encode_text(res.text)
    else:
        return set()
    return {t for t in (tenant_of(i) for i in ids) if t is not None and t != req.tenant}
