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


async def _probe(engine: Engine, known=None):
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        return await run_probe(client, ProbeTarget("http://engine/v1", limit=LIMIT), max_tokens=16, known=known)


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


def _garbled(canary: str, digits: int) -> str:
    """``canary`` with its last ``digits`` hex digits changed."""
    tail = "".join("0" if ch != "0" else "1" for ch in canary[-digits:])
    return canary[:-digits] + tail


@pytest.mark.parametrize(("digits", "outcome", "surfaced"), [(1, "leak", 2), (4, "leak", 2), (9, "clean", 0)])
async def test_a_garbled_copy_of_an_earlier_steps_canary_in_a_plant_answer(digits: int, outcome: str, surfaced: int):
    """Decode reading stale pages copies them imperfectly: a copy of an earlier step's canary
    with up to 4 of 16 hex digits wrong is evidence; one that far off is noise (unmatched)."""

    def answer(prompt: str, seen: list[str]) -> str:
        earlier = [c for p in seen for c in _own(p)]
        return f"stale: {_garbled(earlier[0], digits)}" if earlier and _own(prompt) else "nothing"

    result = await _probe(Engine(answer))
    assert (result.outcome, result.surfaced) == (outcome, surfaced)
    assert [(s.label, s.surfaced, s.unmatched) for s in result.steps][1::2] == [
        ("plant@L", surfaced // 2, 1 - surfaced // 2),
        ("plant@L+1", surfaced // 2, 1 - surfaced // 2),
    ]


@pytest.mark.parametrize("registry", [True, False])
async def test_another_runs_canary_in_a_plant_answer_is_a_leak_when_the_registry_knows_it(registry: bool):
    """A canary no step of this run planted, but the registry knows (the previous periodic
    probe's, another replica's, a honeypot tenant's), is evidence; unknown, it is unmatched."""
    previous = "KVGATE-CANARY-00112233445566ff"
    asked: list[list[str]] = []

    async def known(canaries: list[str]) -> list[bool]:
        asked.append(canaries)
        return [c == previous for c in canaries]

    def answer(prompt: str, seen: list[str]) -> str:
        return f"stale: {previous}" if _own(prompt) else "nothing"

    result = await _probe(Engine(answer), known=known if registry else None)
    assert (result.outcome, result.surfaced) == (("leak", 3) if registry else ("clean", 0))
    assert [s.unmatched for s in result.steps] == ([0] * 5 if registry else [1, 1, 0, 1, 0])
    assert asked == ([[previous]] * 3 if registry else [])
