"""An HF folder served across three processes (``--role decode``, ``--role prefill``, ``--role router``,
as docker-compose runs them): the router tokenizes with the folder's tokenizer, the prefill node samples
the first token, the decode node the rest; both stop on the folder's EOS ids.

The folder is ``tests/tiny_hf.py``'s (its own BPE tokenizer, ``</s>`` and, only in
``generation_config.json``, id 0 as EOS), built with a context length of :data:`CTX` so that the
default ``--context-length`` (8,192) would be wrong. Expected answers come from ``transformers``'
greedy ``generate`` on the same weights.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from backend_procs import Backend
from tiny_hf import build_folder

from tokenizer.hf_counter import HFCounter

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CTX = 512
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "東京は日本の首都です。 12 + 30 = ?"}],
    [{"role": "user", "content": "for i in range(10):"}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("hf3") / "tiny-hf"
    build_folder(f, silent=False, context_length=CTX)
    return f


@pytest.fixture(scope="module")
def three(folder):
    with Backend(three=True, model=str(folder), pools=(1024, 2048), startup_timeout=180) as b:
        yield b


def _reference(folder, ids: list[int], max_tokens: int, stop_ids: set[int]) -> tuple[list[int], str]:
    """transformers' greedy continuation of ``ids``, cut after the first EOS: (ids, finish_reason)."""
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
    for i, t in enumerate(out):
        if t in stop_ids:
            return out[: i + 1], "stop"
    return out, "length"


def _text(counter: HFCounter, ids: list[int], stop_ids: set[int]) -> str:
    return b"".join(counter.token_bytes(i) for i in ids if i not in stop_ids).decode("utf-8", errors="replace")


@pytest.mark.timeout(300)
def test_three_roles_count_stop_stream_and_context(three, folder):
    counter = HFCounter(folder)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    stop_ids = set(counter.eos_token_ids)
    assert stop_ids == {hf_tok.convert_tokens_to_ids("</s>"), 0}  # generation_config's list

    # /server_info (the router forwards the prefill node's) and /v1/models: the folder's context length
    info = httpx.get(three.url + "/server_info", timeout=10).json()
    assert info["context_length"] == CTX and info["disaggregation_mode"] == "prefill"
    models = httpx.get(three.url + "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny-hf", CTX)]

    outcomes = set()
    for messages in CHATS:
        out = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected_ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        assert counter.encode_chat(messages) == expected_ids and counter.count_chat(messages) == len(expected_ids)
        ref, reason = _reference(folder, expected_ids, 12, stop_ids)
        body = {"model": "tiny-hf", "messages": messages, "max_tokens": 12, "temperature": 0}
        r = httpx.post(three.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        whole = r.json()
        choice = whole["choices"][0]
        assert whole["usage"]["prompt_tokens"] == len(expected_ids)
        assert choice["finish_reason"] == reason, (ref, choice)
        assert whole["usage"]["completion_tokens"] == (len(ref) if reason == "stop" else 12)
        assert choice["message"]["content"] == _text(counter, ref, stop_ids)
        outcomes.add(reason)

        pieces, reasons = [], []
        with httpx.stream("POST", three.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        pieces.append(ch["delta"].get("content") or "")
                        reasons.append(ch.get("finish_reason"))
        assert "".join(pieces) == choice["message"]["content"]
        assert [x for x in reasons if x] == [reason]

    assert outcomes == {"length"}  # these chats run to max_tokens (transformers says so too)

    # "東京" as a completions prompt: the greedy 6th token is </s>, sampled on the decode node
    prompt = "東京"
    ids = counter.encode_prompt_text(prompt)
    assert ids == hf_tok(prompt)["input_ids"] and counter.count_prompt_text(prompt) == len(ids)
    ref, reason = _reference(folder, ids, 12, stop_ids)
    assert reason == "stop" and len(ref) == 6 and ref[-1] == hf_tok.convert_tokens_to_ids("</s>")
    body = {"model": "tiny-hf", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = httpx.post(three.url + "/v1/completions", json=body, timeout=60).json()
    usage = {"prompt_tokens": len(ids), "completion_tokens": 6, "total_tokens": len(ids) + 6}
    assert r["usage"] == {**usage, "prompt_tokens_details": {"cached_tokens": 0}}
    assert (r["choices"][0]["finish_reason"], r["choices"][0]["text"]) == ("stop", _text(counter, ref, stop_ids))
    pieces, reasons = [], []
    with httpx.stream("POST", three.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    pieces.append(ch.get("text") or "")
                    reasons.append(ch.get("finish_reason"))
    assert "".join(pieces) == r["choices"][0]["text"] and [x for x in reasons if x] == ["stop"]
    # at the limit: max_tokens 5 ends one token before that EOS, with length
    r = httpx.post(three.url + "/v1/completions", json={**body, "max_tokens": 5}, timeout=60).json()
    assert (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == ("length", 5)
    assert r["choices"][0]["text"] == _text(counter, ref[:5], stop_ids)
    pools = three.wait_idle()
    assert all(p["all_free"] and p["all_zero"] for p in pools.values()), pools


@pytest.mark.timeout(300)
def test_three_roles_stop_on_an_eos_only_generation_config_names(tmp_path):
    """The silent folder's greedy first token is id 0, an EOS only ``generation_config.json`` names:
    the prefill node stops there (``stop``, no text); with ``ignore_eos`` the decode node runs on to
    exactly ``max_tokens``."""
    folder = tmp_path / "tiny-hf-silent"
    build_folder(folder, silent=True, context_length=CTX)
    with Backend(three=True, model=str(folder), pools=(256, 512), startup_timeout=180) as b:
        body = {"prompt": "Paris is", "max_tokens": 5, "temperature": 0}
        r = httpx.post(b.url + "/v1/completions", json=body, timeout=60).json()
        assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == ""
        assert r["usage"]["completion_tokens"] == 1
        r = httpx.post(b.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=60).json()
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 5
        assert b.wait_idle()["decode"]["all_free"]
