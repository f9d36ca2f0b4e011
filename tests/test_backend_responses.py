"""The bundled engine's ``/v1/responses`` (gpu_backend/responses_api.py, tiny-random model, one
``--role all`` process) through the gateway, driven by the ``openai`` SDK: the engine's
``input_tokens`` equals the gateway's count, a greedy stream equals the whole answer, and the
engine itself refuses stateful requests."""

from __future__ import annotations

import httpx
import openai
import pytest

from config.models import Settings
from tests.backend_procs import Backend
from tests.gateway_harness import KEY_A, MODEL, Gateway, tenants
from tokenizer import bundled_counter
from tokenizer.responses import count_responses, responses_to_chat

pytestmark = pytest.mark.timeout(180)
COUNTER = bundled_counter()


@pytest.fixture(scope="module")
def stack():
    with Backend(three=False, model="tiny-random") as b:
        s = Settings.model_validate(
            {
                "models": [{"id": MODEL, "context_length": 8192}],
                "upstreams": [
                    {
                        "name": "bundled",
                        "api_url": b.url + "/v1",
                        "pool_source": "kvgate",
                        "pool_urls": [b.url + "/server_info"],
                        "models": [MODEL],
                    }
                ],
                "verifier": {"enabled": False},
                "quotas": {"enabled": False},
            }
        )
        g = Gateway(s, tenants()).start()
        try:
            yield b, g
        finally:
            g.stop()


def test_bundled_engine_serves_responses_with_the_gateways_exact_count(stack):
    backend, g = stack
    client = openai.OpenAI(base_url=g.url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Add two and two."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":2,"b":2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
    ]
    tools = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
    expected = count_responses(COUNTER, responses_to_chat(items, "Be brief.", tools))
    kw = {"model": MODEL, "input": items, "instructions": "Be brief.", "tools": tools, "max_output_tokens": 6}
    whole = client.responses.create(**kw, temperature=0)
    assert whole.usage.input_tokens == expected
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 6 and whole.output_text
    events = list(client.responses.create(**kw, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.usage.input_tokens == expected


def test_bundled_engine_refuses_stateful_requests_itself(stack):
    backend, _ = stack
    with httpx.Client(base_url=backend.url, timeout=60) as c:
        for extra, param in (({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id")):
            r = c.post("/v1/responses", json={"input": "hi", **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        r = c.post("/v1/responses", json={"input": [{"type": "item_reference", "id": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].type"
