"""No encode takes a request or a worker down: tiktoken's panic on a long whitespace run
(reproduced here), the whitespace-run encoder that avoids it with the same ids (a property test
against unsplit tiktoken below the panic size), the guard for everything else, and the gateway's
answers on /tokenize and a chat of 1M spaces + "x"."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from config.models import Settings
from tests.gateway_harness import KEY_A, MODEL, Gateway, tenants, upstream
from tests.mock_engine import MockEngine
from tokenizer.encodings import bundled_encoding
from tokenizer.errors import TokenizerError, TokenizerFaultError
from tokenizer.guard import fault_param, guarded
from tokenizer.tiktoken_safe import LONG_WHITESPACE_CHARS, PANIC_WHITESPACE_CHARS, encode_ordinary

ENC = bundled_encoding()
#: 1M spaces + "x": the shape that panics tiktoken (999,999 whitespace characters and more)
PANIC_TEXT = " " * 1_000_000 + "x"


def expected_ids(run: str, tail: str) -> list[int]:
    """tiktoken's ids for a whitespace run (no line break) followed by ``tail`` (a letter run,
    no whitespace), from its regex's rules: ``\\s+(?!\\S)`` takes all of the run but its last
    character, which opens the next pre-token; each pre-token through tiktoken's own BPE."""
    return ENC._encode_single_piece(run[:-1].encode()) + ENC.encode_ordinary(run[-1] + tail)


def test_tiktoken_panics_at_the_measured_bound_and_the_panic_is_no_exception():
    assert PANIC_WHITESPACE_CHARS == 999_999
    with pytest.raises(BaseException) as info:
        ENC.encode_ordinary(" " * PANIC_WHITESPACE_CHARS + "x")
    assert type(info.value).__name__ == "PanicException" and not isinstance(info.value, Exception)
    below = " " * (PANIC_WHITESPACE_CHARS - 1) + "x"
    assert len(ENC.encode_ordinary(below)) == len(expected_ids(below[:-1], "x")) == 7814


WHITESPACE = [" ", "\t", "\n", "\r", "\u3000", "\xa0", "\x0b"]
OTHER = ["x", "yz", "日本", "!", "?!", "12", "1234", "'s", "é", ",", "(", "🙂"]
chunk = st.one_of(
    st.builds(lambda c, n: c * n, st.sampled_from(WHITESPACE), st.integers(1, 12)),
    st.sampled_from(OTHER),
    st.builds(lambda a, b: a + b, st.sampled_from(WHITESPACE), st.sampled_from(OTHER)),
)
texts = st.lists(chunk, max_size=30).map("".join)


@settings(max_examples=600, deadline=None, database=None, derandomize=True)
@given(texts, st.integers(2, 8))
def test_the_split_encoding_equals_tiktoken(text, threshold):
    """With the long-run threshold lowered to a few characters, every whitespace run takes the
    split path: the ids still equal unsplit tiktoken (whose regex cannot panic on these sizes)."""
    assert encode_ordinary(ENC, text, long_run=threshold) == ENC.encode_ordinary(text)


@pytest.mark.parametrize(
    "text",
    [
        "ab " + " " * LONG_WHITESPACE_CHARS + "x yz",
        "hello\n" + "\t" * (LONG_WHITESPACE_CHARS + 3) + "!",
        "x\n\n" + " \t" * LONG_WHITESPACE_CHARS + "\ny 12",
        "日本" + "\u3000" * LONG_WHITESPACE_CHARS + "語",
        " " * LONG_WHITESPACE_CHARS,
    ],
)
def test_real_size_runs_encode_as_tiktoken(text):
    assert encode_ordinary(ENC, text) == ENC.encode_ordinary(text)


class Boom(BaseException):
    """Stands for pyo3_runtime.PanicException (a BaseException)."""


def _raise(exc: BaseException):
    def f(*_a):
        raise exc

    return f


def test_guard_turns_a_panic_into_a_typed_error_and_lets_stops_through():
    with pytest.raises(TokenizerFaultError) as info, fault_param("prompt[1]"):
        guarded(_raise(Boom("regex")), "text")
    assert info.value.param == "prompt[1]" and info.value.cause == "Boom" and info.value.status == 400
    for stop in (KeyboardInterrupt(), SystemExit(1), asyncio.CancelledError()):
        with pytest.raises(type(stop)):
            guarded(_raise(stop), "text")
    with pytest.raises(TokenizerError) as typed:
        guarded(_raise(TokenizerError("mine", "messages")), "t")
    assert type(typed.value) is TokenizerError


#: the panicking text's ids as tiktoken's regex defines them (999,999 spaces, then " x")
PANIC_TOKENS = 7814
#: ChatML around one user message: <|im_start|> "user" "\n" ... <|im_end|> "\n" <|im_start|> "assistant\n"
#: ("user\n" and the run: the line break is a pre-token of its own, \s*[\r\n] backtracking to it)
CHAT_EXTRA = 1 + len(ENC.encode_ordinary("user")) + len(ENC.encode_ordinary("\n")) + 1 + 1 + 1 + 2


def test_the_split_path_gives_the_regex_ids_of_the_panicking_text():
    ids = encode_ordinary(ENC, PANIC_TEXT)
    assert ids == expected_ids(PANIC_TEXT[:-1], "x") and len(ids) == PANIC_TOKENS
    assert len(ENC.encode_ordinary("assistant\n")) == 2 and CHAT_EXTRA == 8


@pytest.fixture(scope="module")
def gw():
    engine = MockEngine().start()
    s = Settings.model_validate(
        {
            "gateway": {"max_body_bytes": 4 << 20, "connect_timeout_seconds": 1, "read_timeout_seconds": 5},
            "pool": {"poll_interval_seconds": 0.2, "max_staleness_seconds": 5, "request_timeout_seconds": 2.0},
            "models": [{"id": MODEL, "context_length": 32768}],
            "upstreams": [{**upstream("u1", engine), "models": [MODEL]}],
            "verifier": {"enabled": False},
            "quotas": {"enabled": False},
        }
    )
    engine.state.pool_tokens = 65536
    g = Gateway(s, tenants(max_context_tokens=32768)).start()
    yield g, engine
    g.stop()
    engine.stop()


@pytest.mark.timeout(120)
def test_tokenize_and_chat_of_the_panicking_text_get_the_exact_count(gw):
    """Before: uvicorn's plain-text 500 on both routes. Now the exact count (the split path),
    and the chat is forwarded."""
    g, engine = gw
    with g.client(KEY_A, timeout=60) as c:
        r = c.post("/tokenize", json={"model": MODEL, "prompt": PANIC_TEXT})
        assert r.status_code == 200, r.text
        assert r.json()["count"] == PANIC_TOKENS and len(r.json()["tokens"]) == PANIC_TOKENS
        r = c.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": PANIC_TEXT}]})
        assert r.status_code == 200 and r.json()["count"] == PANIC_TOKENS + CHAT_EXTRA, r.text
        before = len(engine.state.requests)
        body = {"model": MODEL, "messages": [{"role": "user", "content": PANIC_TEXT}], "max_tokens": 8}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert len(engine.state.requests) == before + 1


def test_engine_text_the_tokenizer_fails_on_is_settled_at_its_byte_length():
    """Completion text from an engine is counted for settling; a tokenizer fault there falls
    back to the UTF-8 byte length (never fewer tokens) instead of failing the settle."""
    from gateway.relay.finish import completion_tokens_of

    class Failing:
        offload_chars = 32_768

        def count_text(self, text: str) -> int:
            return guarded(_raise(Boom("regex")), text)

    assert asyncio.run(completion_tokens_of(Failing(), ["héllo", ["a", "b"]])) == 6 + 2  # type: ignore[arg-type]
