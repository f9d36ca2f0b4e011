"""The HTTP checks scripts/compose-e2e.sh runs against the compose stack's published gateway.

Standard library only (it runs with the host's python3, no venv). ``BASE`` (http://127.0.0.1:PORT)
and ``KEY`` (the gateway's generated key) come from the environment; argv[1] is ``full`` (every
check), ``key`` (after a restart: the same key still gets a 200) or ``replicas`` (run inside the
compose network: ``BASE`` and ``BASE2`` are two gateway containers sharing Redis, ``KEY`` a tenant
with RPM 4). Exits 1 on the first failure.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from email.message import Message

BASE = os.environ["BASE"]
KEY = os.environ["KEY"]
MODEL = "kvgate-tiny"


def call(method: str, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, str, str]:
    """(status, content type, body text) of one request to ``BASE``; HTTP errors are answers too."""
    status, headers, text = call_headers(method, path, body, key)
    return status, headers.get("Content-Type", ""), text


def call_headers(
    method: str, path: str, body: dict | None = None, key: str | None = KEY, base: str = BASE
) -> tuple[int, Message, str]:
    """(status, headers (names in any case), body text) of one request; HTTP errors are answers too."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


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
    for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
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
    store_up = metric(text, "kvgate_quota_store_up")
    expect(store_up == 1, "kvgate_quota_store_up == 1 (the gateway's Redis answers)", store_up)


def replicas() -> None:
    """Two gateway hosts sharing Redis enforce one RPM window: the tenant's four requests,
    alternating hosts, each say how many remain across both (3, 2, 1, 0), then each host
    answers the fifth and sixth with the 429 and its exact message."""
    base2 = os.environ["BASE2"]
    deadline, known = time.monotonic() + 30, 0
    while known < 8:  # each of the first host's workers re-reads the tenants file (polled): 8 in a row
        known = known + 1 if call("GET", "/v1/models")[0] == 200 else 0
        expect(time.monotonic() < deadline, "the first gateway's workers know the new tenant within 30 s")
        time.sleep(0.25)
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}]}
    for i, base in enumerate([base2, BASE, base2, BASE]):
        status, headers, text = call_headers("POST", "/v1/chat/completions", body, base=base)
        left = headers.get("x-ratelimit-remaining-requests")
        expect(
            status == 200 and left == str(3 - i),
            f"request {i + 1} via {base} -> 200, {3 - i} left",
            (status, left, text),
        )
    want = re.compile(
        r"Rate limit reached for tenant 'e2e-replicas' on requests per 60s window \(RPM\): "
        r"Limit 4, Used 4, Requested 1\. Please try again in \d+s\."
    )
    for base in (BASE, base2):
        status, headers, text = call_headers("POST", "/v1/chat/completions", body, base=base)
        err = json.loads(text)["error"] if status == 429 else {}
        expect(
            status == 429 and err.get("code") == "rate_limit_exceeded" and want.fullmatch(err.get("message", "")),
            f"request over the RPM via {base} -> 429 rate_limit_exceeded, Used 4",
            text,
        )
        expect(headers.get("x-ratelimit-limit-requests") == "4", "x-ratelimit-limit-requests: 4", headers)


def main() -> None:
    if sys.argv[1:] == ["replicas"]:
        replicas()
        return
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
