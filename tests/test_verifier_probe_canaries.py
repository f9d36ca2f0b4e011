"""The canary probe's evidence rule: a model that echoes its own canary mistyped, or writes new
canary-shaped strings in its pattern, is not a leak; a canary in a fresh prompt's answer is."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from verifier.probe import ProbeTarget, run_probe

LIMIT = 400
CANARY = re.compile(r"KVGATE-CANARY-[0-9a-f]{16}")


def _mistyped(canary: str) -> str:
    last = canary[-1]
    return canary[:-1] + ("0" if last != "0" else "1")


class Engine:
    """An OpenAI completions endpoint with no /tokenize (the probe sizes with its bundled
    tokenizer). ``answer(prompt, seen)`` writes each body's text; ``seen``: earlier prompts."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.prompts: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/completions"):
            return httpx.Response(404, json={"error": {"message": "no such route"}})
        prompt = json.loads(request.content)["prompt"]
        text = self.answer(prompt, list(self.prompts))
        self.prompts.append(prompt)
        return httpx.Response(200, json={"choices": [{"index": 0, "text": text, "finish_reason": "length"}]})


async def _probe(engine: Engine):
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        return await run_probe(client, ProbeTarget("http://engine/v1", limit=LIMIT), max_tokens=16)


def _own(prompt: str) -> list[str]:
    return list(dict.fromkeys(CANARY.findall(prompt)))


async def test_a_mistyped_echo_and_an_imitated_canary_are_not_a_leak():
    def answer(prompt: str, seen: list[str]) -> str:
        own = _own(prompt)
        return f"echo {_mistyped(own[0])} and KVGATE-CANARY-0123456789abcdef" if own else "nothing"

    result = await _probe(Engine(answer))
    assert (result.outcome, result.surfaced, result.exit_code) == ("clean", 0, 0)
    assert [(s.label, s.status, s.surfaced, s.unmatched) for s in result.steps] == [
        ("plant@L/2", 200, 0, 2),
        ("plant@L", 200, 0, 2),
        ("fresh@L", 200, 0, 0),
        ("plant@L+1", 200, 0, 2),
        ("fresh@L+1", 200, 0, 0),
    ]


async def test_an_earlier_steps_canary_in_a_plant_answer_is_a_leak():
    def answer(prompt: str, seen: list[str]) -> str:
        earlier = [c for p in seen for c in _own(p)]
        return f"stale page: {earlier[0]}" if earlier else "nothing"

    result = await _probe(Engine(answer))
    assert (result.outcome, result.surfaced, result.exit_code) == ("leak", 4, 1)
    assert [(s.label, s.surfaced, s.unmatched) for s in result.steps] == [
        ("plant@L/2", 0, 0),
        ("plant@L", 1, 0),
        ("fresh@L", 1, 0),
        ("plant@L+1", 1, 0),
        ("fresh@L+1", 1, 0),
    ]


@pytest.mark.parametrize("garbled", [True, False])
async def test_any_canary_in_a_fresh_answer_is_a_leak(garbled: bool):
    """A fresh prompt holds no canary to imitate: a canary in its answer came from elsewhere,
    even mistyped (decode read stale pages and copied them imperfectly)."""

    def answer(prompt: str, seen: list[str]) -> str:
        if _own(prompt):
            return "nothing"
        last = _own(seen[-1])[0]
        return "stale: " + (_mistyped(last) if garbled else last)

    result = await _probe(Engine(answer))
    assert (result.outcome, result.surfaced) == ("leak", 2)
    assert [(s.label, s.surfaced, s.unmatched) for s in result.steps][2::2] == [("fresh@L", 1, 0), ("fresh@L+1", 1, 0)]
