"""The router's HTTP API (``python -m gpu_backend --role all``, copy-probe, embedded default sizes)
as a real process: SGLang/OpenAI shapes, exact SSE bytes, errors, server_info read from the live
prefill pool, and the CLI's flags and fault parsing."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import orjson
import pytest

from config.errors import context_length_message
from tests.backend_procs import ROOT, Backend
from tokenizer import bundled_counter

pytestmark = pytest.mark.timeout(120)
COUNTER = bundled_counter()
IDS = [9906, 1917, 11, 420, 374, 264, 1296, 315, 279, 20237]  # "Hello world, this is a test of the router"


@pytest.fixture(scope="module")
def backend():
    with Backend(three=False) as b:
        yield b


@pytest.fixture(scope="module")
def client(backend):
    with httpx.Client(base_url=backend.url, timeout=60) as c:
        yield c


def test_server_info_reports_the_live_prefill_pool_with_sglang_names(client):
    info = client.get("/server_info").json()
    assert {
        k: info[k]
        for k in (
            "max_total_num_tokens",
            "max_req_input_len",
            "context_length",
            "page_size",
            "disaggregation_mode",
            "status",
            "free_tokens",
            "used_tokens",
        )
    } == {
        "max_total_num_tokens": 4096,
        "max_req_input_len": 4090,
        "context_length": 8192,
        "page_size": 16,
        "disaggregation_mode": "prefill",
        "status": "ready",
        "free_tokens": 4096,
        "used_tokens": 0,
    }
    assert info["version"] == "kvgate-backend-0.1.0"
    alias = client.get("/get_server_info").json()
    assert alias == info
    assert client.get("/health").status_code == 200


def test_models_and_tokenize_and_detokenize(client):
    models = client.get("/v1/models").json()
    assert [(m["id"], m["max_model_len"], m["object"], m["owned_by"]) for m in models["data"]] == [
        ("kvgate-tiny", 8192, "model", "kvgate"),
        ("copy-probe", 8192, "model", "kvgate"),
    ]
    text = "Cloudflare 安全事件复盘 — <|im_end|> stays text"
    r = client.post("/v1/tokenize", json={"model": "kvgate-tiny", "prompt": text}).json()
    assert r == {"tokens": COUNTER.encode_text(text), "count": COUNTER.count_text(text), "max_model_len": 8192}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    r = client.post("/v1/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == COUNTER.encode_chat(msgs) and r["count"] == COUNTER.count_chat(msgs) == len(r["tokens"])
    assert client.post("/v1/detokenize", json={"tokens": IDS}).json() == {"text": COUNTER.decode(IDS)}
    bad = client.post("/v1/detokenize", json={"tokens": [1, -5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_completion_copies_the_prompt_with_usage_and_prefill_header(client):
    r = client.post("/v1/completions", json={"model": "kvgate-tiny", "prompt": IDS, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200
    assert float(r.headers["x-prefill-seconds"]) > 0
    body = r.json()
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", body["id"]) and isinstance(body["created"], int)
    assert body == {
        "id": body["id"],
        "object": "text_completion",
        "created": body["created"],
        "model": "kvgate-tiny",
        "choices": [{"index": 0, "text": COUNTER.decode(IDS[:6]), "logprobs": None, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 6,
            "total_tokens": 16,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


def test_completion_stream_bytes_with_include_usage(client):
    req = {
        "prompt": IDS[:3],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=req) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    rid, created = re.search(rb'"id":"(cmpl-[0-9a-f]{32})","object":"text_completion","created":(\d+)', raw).groups()
    head = b'{"id":"' + rid + b'","object":"text_completion","created":' + created + b',"model":"kvgate-tiny",'
    texts = [orjson.dumps(COUNTER.decode([t])) for t in IDS[:3]]
    expected = b"".join(
        b"data: " + head + b'"choices":[{"index":0,"text":' + t + b',"logprobs":null,"finish_reason":null}],'
        b'"usage":null}\n\n'
        for t in texts
    )
    expected += (
        b"data: " + head + b'"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}],'
        b'"usage":null}\n\n'
    )
    expected += (
        b"data: " + head + b'"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6,'
        b'"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
    )
    expected += b"data: [DONE]\n\n"
    assert raw == expected


def test_chat_counts_equal_the_gateway_and_stream_bytes_are_exact(client):
    msgs = [{"role": "user", "content": "Hi there"}]
    prompt_ids = COUNTER.encode_chat(msgs)  # <|im_start|> user \n Hi there <|im_end|> \n <|im_start|> assistant \n
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"])
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "<|im_start|>user\n"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": COUNTER.count_chat(msgs),
        "completion_tokens": 3,
        "total_tokens": len(prompt_ids) + 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # streamed: copy-probe walks the template and stops at <|im_end|> (EOS): finish_reason "stop"
    with client.stream(
        "POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 20, "temperature": 0, "stream": True}
    ) as s:
        raw = s.read()
    rid, created = re.search(
        rb'"id":"(chatcmpl-[0-9a-f]{32})","object":"chat.completion.chunk","created":(\d+)', raw
    ).groups()
    head = (
        b'data: {"id":"'
        + rid
        + b'","object":"chat.completion.chunk","created":'
        + created
        + b',"model":"kvgate-tiny","choices":[{"index":0,"delta":'
    )
    tail = b',"logprobs":null,"finish_reason":null}]}\n\n'
    expected = head + b'{"role":"assistant","content":""}' + tail
    for piece in ["<|im_start|>", "user", "\n", "Hi", " there"]:
        expected += head + b'{"content":' + orjson.dumps(piece) + b"}" + tail
    expected += head + b'{},"logprobs":null,"finish_reason":"stop"}]}\n\n' + b"data: [DONE]\n\n"
    assert raw == expected


def test_generate_native_shape_stream_and_not(client):
    r = client.post(
        "/generate", json={"input_ids": IDS, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "rid": "gen-1"}
    )
    body = r.json()
    assert r.status_code == 200 and float(r.headers["x-prefill-seconds"]) > 0
    assert body["text"] == COUNTER.decode(IDS[:4]) and body["output_ids"] == IDS[:4]
    mi = body["meta_info"]
    assert {k: mi[k] for k in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens")} == {
        "id": "gen-1",
        "finish_reason": {"type": "length", "length": 4},
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "cached_tokens": 0,
    }
    with client.stream(
        "POST",
        "/generate",
        json={"text": "Hello world", "stream": True, "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    ) as s:
        events = [e for e in s.read().split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    hello = COUNTER.encode_text("Hello world")
    assert [c["output_ids"] for c in chunks] == [hello[:1], hello[:2]]  # cumulative, as SGLang streams
    assert [c["text"] for c in chunks] == ["Hello", "Hello world"]
    assert [c["meta_info"]["finish_reason"] for c in chunks] == [None, {"type": "length", "length": 2}]


@pytest.mark.parametrize(
    "path, body, status, error",
    [
        (
            "/v1/completions",
            {"prompt": [1000] * 4091, "max_tokens": 1},
            400,
            {
                "message": context_length_message(4090, 4091, 0, messages=False),
                "type": "invalid_request_error",
                "param": "prompt",
                "code": "context_length_exceeded",
            },
        ),
        (
            "/v1/completions",
            {"prompt": [1000] * 8190, "max_tokens": 16},
            400,
            {
                "message": context_length_message(8192, 8190, 16, messages=False),
                "type": "invalid_request_error",
                "param": "prompt",
                "code": "context_length_exceeded",
            },
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                        ],
                    }
                ]
            },
            400,
            {
                "message": "This model does not accept image content parts.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "invalid_request",
            },
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "n": 2},
            400,
            {
                "message": "Only 'n' = 1 is supported by this backend.",
                "type": "invalid_request_error",
                "param": "n",
                "code": "invalid_request",
            },
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            400,
            {
                "message": "'stream_options' is only allowed when 'stream' is true.",
                "type": "invalid_request_error",
                "param": "stream_options",
                "code": "invalid_request",
            },
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "model": "gpt-9"},
            404,
            {
                "message": "The model 'gpt-9' does not exist.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            },
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "temperature": "hot"},
            400,
            {
                "message": "'temperature' must be a number.",
                "type": "invalid_request_error",
                "param": "temperature",
                "code": "invalid_request",
            },
        ),
        (
            "/v1/completions",
            {"prompt": [[1, 2], [3]]},
            400,
            {
                "message": "Batched prompts are not supported by this backend; send one prompt per request.",
                "type": "invalid_request_error",
                "param": "prompt",
                "code": "invalid_request",
            },
        ),
        (
            "/generate",
            {"text": "hi", "input_ids": [1]},
            400,
            {
                "message": "Exactly one of 'text' and 'input_ids' is required.",
                "type": "invalid_request_error",
                "param": "text",
                "code": "invalid_request",
            },
        ),
    ],
)
def test_errors_are_openai_shaped(client, path, body, status, error):
    r = client.post(path, json=body)
    assert (r.status_code, r.json()) == (status, {"error": error})


def test_over_length_chat_names_the_messages(client):
    msgs = [{"role": "user", "content": "word " * 5000}]
    n = COUNTER.count_chat(msgs)
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8})
    assert r.status_code == 400 and n > 4090
    assert r.json() == {
        "error": {
            "message": context_length_message(4090, n, 0, messages=True),
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }


def test_bad_json_and_unknown_routes(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith("Request body is not valid JSON")
    r = client.get("/v1/nope")
    assert (r.status_code, r.json()) == (
        404,
        {
            "error": {
                "message": "Unknown route: GET /v1/nope",
                "type": "invalid_request_error",
                "param": None,
                "code": "not_found",
            }
        },
    )
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_pools_are_idle_and_scrubbed_after_the_module(backend, client):
    pools = backend.wait_idle()
    assert pools["prefill"]["all_free"] and pools["prefill"]["all_zero"], pools
    assert pools["decode"]["all_free"] and pools["decode"]["all_zero"], pools
    assert pools["prefill"]["total_pages"] == 256 and pools["decode"]["total_pages"] == 1024


def _run_cli(args: list[str], env_faults: str | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVGATE_FAULTS", None)
    if env_faults is not None:
        env["KVGATE_FAULTS"] = env_faults
    return subprocess.run(
        [sys.executable, "-c", "import sys; from gateway.cli import main; sys.exit(main())", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_kvgate_backend_cli_flags_and_fault_names():
    r = _run_cli(["backend", "--help"])
    assert r.returncode == 0
    for flag in (
        "--role",
        "--host",
        "--port",
        "--prefill-url",
        "--decode-url",
        "--model",
        "--served-model-name",
        "--device",
        "--context-length",
        "--page-size",
        "--max-total-tokens",
        "--mem-budget-bytes",
        "--prefill-max-total-tokens",
        "--decode-max-total-tokens",
    ):
        assert flag in r.stdout
    r = _run_cli(["backend", "--role", "router"], env_faults="admit_rejected,no_scrubs")
    assert r.returncode == 2
    assert "KVGATE_FAULTS: unknown fault(s) no_scrubs; known: admit_rejected, no_scrub, skip_transfer_check" in r.stderr
