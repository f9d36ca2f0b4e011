"""The backend's wire types (gpu_backend/wire.py): one Token, one PrefillOutcome, one engine id, and
their JSON shapes exactly as the decode stream and /disagg/prefill carry them; and the
``KVGATE_FAULTS`` format (gpu_backend/faults.py)."""

from __future__ import annotations

import orjson
import pytest

from gpu_backend.faults import NO_FAULTS, Faults, UnknownFaultError, faults_from_env, parse_faults
from gpu_backend.wire import PrefillOutcome, Token, engine_request_id


def test_token_json_is_the_six_fields_and_round_trips():
    tok = Token(42, "hé", True, "length", 7, 3)
    assert tok.to_json() == {
        "token_id": 42,
        "text": "hé",
        "finished": True,
        "finish_reason": "length",
        "prompt_tokens": 7,
        "completion_tokens": 3,
    }
    assert Token.from_json(orjson.loads(orjson.dumps(tok.to_json()))) == tok


FIELDS = "token_id, text, finished, finish_reason, prompt_tokens, completion_tokens"
TOKEN = {
    "token_id": 1,
    "text": "",
    "finished": False,
    "finish_reason": None,
    "prompt_tokens": 1,
    "completion_tokens": 1,
}


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({k: v for k, v in TOKEN.items() if k != "completion_tokens"}, f"a Token has exactly the fields {FIELDS}"),
        ({**TOKEN, "extra": 1}, f"a Token has exactly the fields {FIELDS}"),
        ([1, "", False], f"a Token has exactly the fields {FIELDS}"),
        ({**TOKEN, "token_id": "7"}, "Token.token_id must be int, not str"),
        ({**TOKEN, "token_id": True}, "Token.token_id must be int, not bool"),
        ({**TOKEN, "finished": 0}, "Token.finished must be bool, not int"),
        ({**TOKEN, "finish_reason": 3}, "Token.finish_reason must be str | None, not int"),
    ],
)
def test_token_from_json_refuses_missing_unknown_or_mistyped_fields(obj, message):
    """What a faulty decode peer may send: each refused with a ValueError naming the misfit (the
    router answers 502), never a TypeError from the constructor or a token of the wrong types."""
    with pytest.raises(ValueError) as e:
        Token.from_json(obj)
    assert str(e.value) == message


def test_prefill_outcome_json_round_trips_and_compares_by_value():
    out = PrefillOutcome(40, 1000, 0.25, False, 40)
    assert out.to_json() == {
        "num_tokens": 40,
        "first_token_id": 1000,
        "prefill_seconds": 0.25,
        "placeholder": False,
        "original_prompt_tokens": 40,
    }
    assert PrefillOutcome.from_json(orjson.loads(orjson.dumps(out.to_json()))) == out
    with pytest.raises(ValueError, match="^a PrefillOutcome has exactly the fields num_tokens, first_token_id, "):
        PrefillOutcome.from_json({**out.to_json(), "kv": []})
    with pytest.raises(ValueError, match="^PrefillOutcome.prefill_seconds must be float, not str$"):
        PrefillOutcome.from_json({**out.to_json(), "prefill_seconds": "0.25"})


def test_engine_request_id_is_unique_per_room_and_fixed_width():
    assert engine_request_id("r", 1) == "r@0000000000000001"
    assert engine_request_id("r", (1 << 63) - 1) == "r@7fffffffffffffff"
    assert engine_request_id("a@b", 16) == "a@b@0000000000000010"
    assert len({engine_request_id("same", room) for room in range(100)}) == 100


def test_kvgate_faults_parse_into_one_frozen_value_and_refuse_unknown_names():
    assert parse_faults(None) == parse_faults("") == parse_faults(" , ") == NO_FAULTS == Faults()
    both = parse_faults(" no_scrub,admit_rejected ,")
    assert both == Faults(admit_rejected=True, no_scrub=True) and not both.skip_transfer_check
    assert both.names == ["admit_rejected", "no_scrub"] and NO_FAULTS.names == []
    assert faults_from_env({"KVGATE_FAULTS": "skip_transfer_check"}) == Faults(skip_transfer_check=True)
    with pytest.raises(UnknownFaultError, match=r"unknown fault\(s\) no_scrubs; known: admit_rejected, no_scrub, "):
        parse_faults("no_scrub,no_scrubs")
    with pytest.raises(AttributeError):  # frozen: a process's switches do not change after start-up
        both.no_scrub = False  # type: ignore[misc]
