"""A tiny, fast mock of an OpenAI-compatible engine in the bundled backend's shape (benchmarks and
development only; not a test fixture, not imported by the project).

A raw asyncio HTTP/1.1 server (keep-alive, Content-Length bodies, chunked SSE for streams), so
the upstream is never the bottleneck of ``bench/gateway.py``. Routes (as the bundled backend,
docs/design.md "The bundled backend"):

- ``GET /health`` -> 200; ``GET /server_info`` | ``/get_server_info`` -> the SGLang flat dict
  (``max_total_num_tokens`` = ``--pool-tokens``, ``context_length``, ``max_req_input_len``, ...);
- ``GET /v1/models`` -> one model with ``max_model_len``;
- ``POST /v1/completions`` | ``/v1/chat/completions`` -> a completion of ``min(max_tokens, 8)``
  tokens ``" tok"``; ``stream: true`` sends one SSE event per token, a usage event, ``[DONE]``.
  ``usage.prompt_tokens`` is 0 unless ``--count`` (then the bundled tokenizer's exact count).
- ``POST /v1/responses`` -> a whole ``response`` object of the same completion (usage
  ``input_tokens`` / ``output_tokens``).

Run: ``python bench/mock_engine.py --port 30000 [--model kvgate-tiny] [--count]``.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this folder is sys.path[0]; a bench named like a stdlib module (bench/tokenize.py)
# would shadow it. Benches import nothing from their own folder, so drop it.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse
import asyncio
import json
import signal
import time

try:
    import orjson

    def _dumps(obj: object) -> bytes:
        return orjson.dumps(obj)

    _loads = orjson.loads
except ImportError:  # pragma: no cover

    def _dumps(obj: object) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    _loads = json.loads

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed"}


class Engine:
    """What the mock answers; ``count`` is ``None`` or a function (request dict, chat?) -> prompt tokens."""

    def __init__(self, model: str, context_length: int, pool_tokens: int, count: object = None) -> None:
        self.model = model
        self.context_length = context_length
        self.pool_tokens = pool_tokens
        self.count = count
        self.server_info = _dumps(
            {
                "max_total_num_tokens": pool_tokens,
                "max_req_input_len": context_length - 6,
                "context_length": context_length,
                "page_size": 16,
                "disaggregation_mode": "null",
                "status": "ready",
                "version": "mock-0",
                "served_model_name": model,
            }
        )
        self.models = _dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "kvgate-mock",
                        "max_model_len": context_length,
                    }
                ],
            }
        )

    def _prompt_tokens(self, req: dict, chat: bool) -> int:
        if self.count is None:
            return 0
        try:
            return int(self.count(req, chat))  # type: ignore[operator]
        except Exception:
            return 0

    def respond(self, req: dict) -> bytes:
        """A whole ``/v1/responses`` answer (never streamed here): ``min(max_output_tokens, 8)`` tokens."""
        n = max(1, min(int(req.get("max_output_tokens") or 16), 8))
        prompt_tokens = self._prompt_tokens(req, None)  # type: ignore[arg-type]
        item = {"id": "msg_mock", "type": "message", "role": "assistant", "status": "completed"}
        item["content"] = [{"type": "output_text", "text": " tok" * n, "annotations": []}]
        usage = {"input_tokens": prompt_tokens, "output_tokens": n, "total_tokens": prompt_tokens + n}
        obj = {"id": "resp_mock", "object": "response", "created_at": int(time.time()), "model": self.model}
        return _dumps({**obj, "status": "completed", "error": None, "output": [item], "usage": usage})

    def complete(self, req: dict, chat: bool) -> tuple[int, list[bytes] | bytes]:
        """(status, body bytes) or (200, list of SSE events) for a stream."""
        max_tokens = req.get("max_completion_tokens") or req.get("max_tokens") or 16
        n = max(1, min(int(max_tokens), 8))
        prompt_tokens = self._prompt_tokens(req, chat)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        finish = "length" if n < 8 or int(max_tokens) == 8 else "stop"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        rid = "chatcmpl-mock" if chat else "cmpl-mock"
        if not req.get("stream"):
            text = " tok" * n
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                if chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            )
            return 200, _dumps(
                {"id": rid, "object": obj, "created": created, "model": self.model, "choices": [choice], "usage": usage}
            )
        events = []
        cobj = "chat.completion.chunk" if chat else "text_completion"
        for i in range(n):
            last = i == n - 1
            choice = (
                {
                    "index": 0,
                    "delta": ({"role": "assistant", "content": " tok"} if i == 0 else {"content": " tok"}),
                    "finish_reason": finish if last else None,
                }
                if chat
                else {"index": 0, "text": " tok", "logprobs": None, "finish_reason": finish if last else None}
            )
            events.append(
                b"data: "
                + _dumps({"id": rid, "object": cobj, "created": created, "model": self.model, "choices": [choice]})
                + b"\n\n"
            )
        opts = req.get("stream_options") or {}
        if isinstance(opts, dict) and opts.get("include_usage"):
            events.append(
                b"data: "
                + _dumps(
                    {"id": rid, "object": cobj, "created": created, "model": self.model, "choices": [], "usage": usage}
                )
                + b"\n\n"
            )
        events.append(b"data: [DONE]\n\n")
        return 200, events


def _response(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
        % (status, _REASONS.get(status, b"Error"), ctype, len(body))
    ) + body


def _error(status: int, message: str) -> bytes:
    return _response(
        status,
        _dumps({"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status}),
    )


class Http(asyncio.Protocol):
    """One keep-alive connection: parse request heads and Content-Length bodies, answer in order."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].split(b"\r\n")
            length = 0
            close = False
            for line in head[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value.strip() or 0)
                elif name == b"connection" and value.strip().lower() == b"close":
                    close = True
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            parts = head[0].split(b" ")
            method, path = parts[0], parts[1].split(b"?")[0] if len(parts) > 1 else b"/"
            self.handle(method, path, body)
            if close and self.transport is not None:
                self.transport.close()
                return

    def handle(self, method: bytes, path: bytes, body: bytes) -> None:
        t = self.transport
        assert t is not None
        e = self.engine
        if method == b"GET":
            if path == b"/health":
                t.write(_response(200, b""))
            elif path in (b"/server_info", b"/get_server_info"):
                t.write(_response(200, e.server_info))
            elif path == b"/v1/models":
                t.write(_response(200, e.models))
            else:
                t.write(_error(404, "not found"))
            return
        if method != b"POST" or path not in (b"/v1/chat/completions", b"/v1/completions", b"/v1/responses"):
            t.write(_error(404 if method == b"POST" else 405, "not found"))
            return
        try:
            req = _loads(body)
            assert isinstance(req, dict)
        except Exception:
            t.write(_error(400, "invalid JSON body"))
            return
        if path == b"/v1/responses":
            t.write(_response(200, e.respond(req)))
            return
        status, out = e.complete(req, path == b"/v1/chat/completions")
        if isinstance(out, bytes):
            t.write(_response(status, out))
            return
        chunks = [
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        ]
        chunks += [b"%x\r\n%s\r\n" % (len(ev), ev) for ev in out]
        chunks.append(b"0\r\n\r\n")
        t.write(b"".join(chunks))


def _bundled_count(req: dict, chat: bool | None) -> int:
    from tokenizer import bundled_counter  # the project's tokenizer (cl100k_base + ChatML)

    c = _bundled_count.counter  # type: ignore[attr-defined]
    if c is None:
        c = _bundled_count.counter = bundled_counter()  # type: ignore[attr-defined]
    if chat is None:  # /v1/responses: the chat the gateway counts (tokenizer.responses)
        from tokenizer.responses import count_responses, responses_to_chat

        return count_responses(c, responses_to_chat(req.get("input"), req.get("instructions"), req.get("tools")))
    return c.count_chat(req.get("messages")) if chat else c.count_prompt(req.get("prompt")).largest


_bundled_count.counter = None  # type: ignore[attr-defined]


async def serve(host: str, port: int, engine: Engine) -> None:
    """Serve until SIGTERM/SIGINT."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Http(engine), host, port, backlog=2048, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"mock engine on http://{host}:{port}", flush=True)
    await stop.wait()
    server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--model", "--served-model-name", dest="model", default="kvgate-tiny")
    ap.add_argument("--context-length", type=int, default=8192)
    ap.add_argument("--pool-tokens", type=int, default=4096)
    ap.add_argument("--count", action="store_true", help="report exact usage.prompt_tokens (bundled tokenizer)")
    args, _unknown = ap.parse_known_args()  # tolerate the bundled backend's other flags
    engine = Engine(args.model, args.context_length, args.pool_tokens, _bundled_count if args.count else None)
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.host, args.port, engine))


if __name__ == "__main__":
    main()
