"""The HTTP checks scripts/compose-e2e.sh runs against the compose stack's published gateway.

Standard library only (it runs with the host's python3, no venv). ``BASE`` (http://127.0.0.1:PORT)
and ``KEY`` (the gateway's generated key) come from the environment; argv[1] is ``full`` (every
check) or ``key`` (after a restart: the same key still gets a 200). Exits 1 on the first failure.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.error
import urllib.request

BASE = os.environ["BASE"]
KEY = os.environ["KEY"]
MODEL = "kvgate-tiny"


def call(method: str, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, str, str]:
    """(status, content type, body text) of one request; HTTP errors are answers too."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def expect(ok: bool, what: str, detail: object = "") -> None:
    if not ok:
        print(f"compose-e2e: FAILED {what}: {str(detail)[:2000]}", file=sys.stderr)
        sys.exit(1)
    print(f"compose-e2e: ok   {what}")


def models() -> int:
    """``/v1/models``: a 401 without the key, the model with its live limit with it; returns the limit."""
    status, _, _ = call("GET", "/v1/models", key=None)
    expect(status == 401, "GET /v1/models without a key -> 401", status)
    status, _, text = call("GET", "/v1/models")
    expect(status == 200, "GET /v1/models -> 200", text)
    data = json.loads(text)["data"]
    expect([m["id"] for m in data] == [MODEL], f"/v1/models lists {MODEL}", data)
    limit = int(data[0]["max_model_len"])
    print(f"compose-e2e:      max_model_len {limit}")
    return limit


def count(messages: list[dict]) -> int:
    status, _, text = call("POST", "/tokenize", {"model": MODEL, "messages": messages})
    expect(status == 200, "POST /tokenize -> 200", text)
    return int(json.loads(text)["count"])


def long_messages(limit: int) -> tuple[list[dict], int]:
    """A user message whose prompt is a little under ``limit`` tokens, and its count."""
    base = count([{"role": "user", "content": "hello"}])
    per_word = count([{"role": "user", "content": "hello" + " hello" * 100}]) - base
    words = max(0, (limit - 16 - base) * 100 // max(per_word, 1))
    while True:
        messages = [{"role": "user", "content": "hello" + " hello" * words}]
        n = count(messages)
        if n < limit:
            return messages, n
        words -= 8


def boundary(limit: int) -> None:
    """prompt + max_tokens == limit -> 200; one more -> 400 context_length_exceeded, exact message."""
    messages, prompt = long_messages(limit)
    room = limit - prompt
    status, _, text = call("POST", "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": room})
    expect(status == 200, f"chat at the limit ({prompt} prompt + {room} completion = {limit}) -> 200", text)
    usage = json.loads(text)["usage"]
    expect(usage["prompt_tokens"] == prompt, f"usage.prompt_tokens == {prompt}", usage)
    expect(1 <= usage["completion_tokens"] <= room, f"1 <= usage.completion_tokens <= {room}", usage)
    over = {"model": MODEL, "messages": messages, "max_tokens": room + 1}
    status, _, text = call("POST", "/v1/chat/completions", over)
    expect(status == 400, f"chat one token over ({limit + 1}) -> 400", text)
    err = json.loads(text)["error"]
    want = (
        f"This model's maximum context length is {limit} tokens. However, you requested {limit + 1} tokens "
        f"({prompt} in the messages, {room + 1} in the completion). "
        "Please reduce the length of the messages or completion."
    )
    expect(err["code"] == "context_length_exceeded", "error.code == context_length_exceeded", err)
    expect(err["message"] == want, "error.message is the engine's", err)


def stream() -> None:
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi."}]}
    status, ctype, text = call("POST", "/v1/chat/completions", body)
    expect(status == 200 and ctype.startswith("text/event-stream"), "streamed chat -> 200 text/event-stream", text)
    events = [line for line in text.split("\n") if line.strip()]
    expect(events[-1] == "data: [DONE]", "the stream ends with data: [DONE]", events[-3:])
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    expect(
        all(c["object"] == "chat.completion.chunk" for c in chunks) and len(chunks) >= 2,
        f"{len(chunks)} chat.completion.chunk events before it",
        chunks[:2],
    )


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name`` over the samples whose labels include ``labels``."""
    total = 0.0
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def metrics(limit: int) -> None:
    status, _, text = call("GET", "/metrics", key=None)
    expect(status == 200, "GET /metrics -> 200", text[:300])
    ok = metric(text, "kvgate_requests_total", tenant="default", status="200")
    refused = metric(text, "kvgate_rejections_total", reason="context_length_exceeded")
    expect(ok >= 2 and refused >= 1, f"/metrics counts the 200s ({ok:g}) and the refusal ({refused:g})")
    effective = metric(text, "kvgate_effective_limit_tokens", upstream="bundled")
    expect(effective == limit, f"kvgate_effective_limit_tokens{{upstream=bundled}} == {limit}", effective)


def main() -> None:
    if sys.argv[1:] == ["key"]:
        models()
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hello."}]}
        status, _, text = call("POST", "/v1/chat/completions", body)
        expect(status == 200, "after the restart, the same key -> chat 200", text)
        return
    limit = models()
    boundary(limit)
    stream()
    metrics(limit)


if __name__ == "__main__":
    main()
