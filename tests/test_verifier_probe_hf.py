"""``kvgate probe`` through the gateway in front of a model with its own Hugging Face tokenizer
(tests/tiny_hf.py: BOS added, a vocabulary unlike cl100k's): every prompt is sized with the
served model's count (the gateway's ``/tokenize``), so ``plant@L`` is exactly at the limit and
answered 200 and ``@L+1`` is refused; an at-limit step that is not answered 200 is exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_hf import build_folder
from tokenizers import Tokenizer

from config.models import Settings
from gateway.cli import main
from tests.gateway_harness import KEY_A, MODEL, Gateway, tenants, upstream
from verifier.shingles import encode

pytestmark = pytest.mark.timeout(120)

LIMIT = 300  # the tenant's max_context_tokens: the effective limit (the pool allows 3276)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("probe-hf") / "tiny-hf"
    build_folder(f, silent=True)
    return f


@pytest.fixture
def gw(engine, folder):
    s = Settings.model_validate(
        {
            "gateway": {"max_body_bytes": 1 << 20, "connect_timeout_seconds": 1, "read_timeout_seconds": 5},
            "pool": {"poll_interval_seconds": 0.2, "max_staleness_seconds": 5, "request_timeout_seconds": 2.0},
            "models": [{"id": MODEL, "context_length": 8192, "tokenizer": {"kind": "hf", "path": str(folder)}}],
            "upstreams": [upstream("u1", engine)],
            "verifier": {"enabled": False},
            "quotas": {"enabled": False},
        }
    )
    g = Gateway(s, tenants(max_context_tokens=LIMIT)).start()
    yield g
    g.stop()


def _probe(gw: Gateway, *extra: str) -> int:
    base = ["probe", "--base-url", gw.url + "/v1", "--api-key", KEY_A, "--model", MODEL]
    return main([*base, "--max-tokens", str(MAX_TOKENS), "--json", *extra])


@pytest.mark.parametrize("extra", [(), ("--limit", str(LIMIT))])
def test_prompts_are_sized_with_the_served_tokenizer_and_the_boundary_is_exercised(gw, engine, folder, capsys, extra):
    # no --limit: the gateway's /tokenize reports the tenant's live limit as max_model_len
    assert _probe(gw, *extra) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["outcome"], doc["limit"], doc["exit_code"], doc["surfaced"]) == ("clean", LIMIT, 0, 0)
    assert [(s["label"], s["prompt_tokens"], s["status"], s["error"]) for s in doc["steps"]] == [
        ("plant@L/2", LIMIT // 2 - MAX_TOKENS, 200, None),
        ("plant@L", LIMIT - MAX_TOKENS, 200, None),
        ("fresh@L", LIMIT - MAX_TOKENS, 200, None),
        ("plant@L+1", LIMIT + 1 - MAX_TOKENS, 400, None),
        ("fresh@L+1", LIMIT + 1 - MAX_TOKENS, 400, None),
    ]
    # what reached the engine, counted by the model's own tokenizer (BOS included): exact; the
    # bundled cl100k count of the same text is not (the sizing the probe used to do)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    sent = [r["body"] for r in engine.state.requests if r["path"] == "/v1/completions"]
    assert [len(tok.encode(b["prompt"]).ids) for b in sent] == [142, 292, 292]
    assert all(b["max_tokens"] == MAX_TOKENS for b in sent)
    assert [len(encode(b["prompt"])) for b in sent] != [142, 292, 292]
    assert "KVGATE-CANARY-" in sent[1]["prompt"] and "KVGATE-CANARY-" not in sent[2]["prompt"]


def test_an_at_limit_step_not_answered_200_is_could_not_tell(gw, capsys):
    # --limit above the tenant's 300: plant@L is refused by the gateway (400), so nothing at the
    # boundary was exercised: exit 2 naming the step, never CLEAN
    assert _probe(gw, "--limit", "400") == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["outcome"] == "unknown" and doc["exit_code"] == 2
    assert [s["status"] for s in doc["steps"]] == [200, 400, 400, 400, 400]
    assert doc["reason"] == (
        "the at-limit request plant@L (prompt 392 + max_tokens 8 = 400 tokens) was answered HTTP 400, not 200:"
        " the boundary was not exercised (the limit or the prompt sizing does not match the served model)"
    )


def test_a_wrong_key_cannot_size_or_probe(gw, capsys):
    code = main(["probe", "--base-url", gw.url + "/v1", "--api-key", "sk-wrong", "--model", MODEL, "--json"])
    assert code == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["outcome"] == "unknown" and doc["limit"] is None


def test_fit_prompt_remote_hits_exact_counts_and_refuses_a_counter_it_cannot_fit():
    import asyncio
    import random

    from verifier.probe import fit_prompt_remote

    calls: list[int] = []

    async def chars(text: str) -> int:  # a coarse tokenizer: ~4 characters a token, plus a BOS
        calls.append(1)
        return 1 + (len(text) + 3) // 4

    for n in (20, 143, 1000):
        calls.clear()
        text = asyncio.run(fit_prompt_remote(chars, n, "KVGATE-CANARY-0123456789abcdef", random.Random(n)))
        assert asyncio.run(chars(text)) == n and len(calls) <= 41

    async def stuck(text: str) -> int:  # a hostile /tokenize: the same count whatever the text
        return 7

    with pytest.raises(ValueError, match="could not size"):
        asyncio.run(fit_prompt_remote(stuck, 100, None, random.Random(0)))
    with pytest.raises(ValueError, match="needs more than 5 tokens"):
        asyncio.run(fit_prompt_remote(stuck, 5, None, random.Random(0)))
