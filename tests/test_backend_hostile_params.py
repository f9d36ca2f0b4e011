"""The engine against one tenant's hostile sampling parameters: a temperature so small that
``logits / temperature`` overflows (it used to fail every sequence of the decode batch it shared),
and stop lists that made every decode step of the one worker thread scan megabytes."""

from __future__ import annotations

import asyncio

import pytest
import torch
from backend_core_support import collect, make_engine, worker_paused  # noqa: F401  (fixture)

from gateway.admission import checks
from gpu_backend import sampling
from gpu_backend.errors import InvalidRequestError
from gpu_backend.sampling import SamplingParams, draw_generator, sample

SMALL = dict(model="tiny-random", max_total_tokens=1024, context_length=1024)


def _prompt(n: int, base: int) -> list[int]:
    return [base + (i * 37) % 9000 for i in range(n)]


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_a_tiny_temperature_samples_at_the_floor_and_never_yields_nan(temperature):
    """As vLLM: a temperature above 0 and below 0.01 samples at 0.01. Row 0's top logit leads
    by 1 (at 0.01 the others weigh e**-100, 0 in fp32), so it is the argmax exactly; row 1 is a
    plain temperature-1 row sharing the batch and sampled as before."""
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0], [0.5, 0.1, 0.2, 0.3]])
    params = [
        SamplingParams(max_new_tokens=1, temperature=temperature),
        SamplingParams(max_new_tokens=1, temperature=1.0),
    ]
    expected_row1 = int(torch.multinomial(torch.softmax(logits[1], -1), 1, generator=draw_generator(2, 9)))
    assert sample(logits, params, [1, 2], [5, 9]) == [1, expected_row1]


async def test_a_tiny_temperature_fails_no_one_in_its_decode_batch(make_engine):
    """A victim decoding greedily and an attacker at temperature 1e-300 admitted in one batch:
    both run to ``max_new_tokens`` and the victim's tokens are those it gets alone. Before the
    floor, sampling raised on the attacker's NaN row and the scheduler failed the whole batch."""
    eng = await make_engine(**SMALL)
    victim_prompt, attacker_prompt = _prompt(20, 1000), _prompt(20, 3000)
    alone, _, _ = await collect(eng, "alone", victim_prompt, max_new_tokens=30, ignore_eos=True)
    with worker_paused(eng):
        victim = asyncio.ensure_future(collect(eng, "victim", victim_prompt, max_new_tokens=30, ignore_eos=True))
        attacker = asyncio.ensure_future(
            collect(eng, "attacker", attacker_prompt, max_new_tokens=30, ignore_eos=True, temperature=1e-300, seed=3)
        )
        await asyncio.sleep(0.05)  # both submitted while the worker waits
    (v_tokens, _, v_last), (a_tokens, _, a_last) = await asyncio.gather(victim, attacker)
    assert v_tokens == alone and v_last.finish_reason == "length"
    assert len(a_tokens) == 30 and a_last.finish_reason == "length"


@pytest.mark.parametrize(
    "stop",
    [
        ["s"] * 17,  # one string too many
        ["x" * 1025],  # one string too long
        ["é" * 513],  # 1,026 UTF-8 bytes in 513 characters
        ["y" * 1000] * 5,  # 5,000 bytes in all
    ],
    ids=["17-strings", "1025-bytes", "1026-utf8-bytes", "5000-bytes-in-all"],
)
async def test_a_stop_list_beyond_the_caps_is_a_400_before_any_work(make_engine, stop):
    eng = await make_engine(**SMALL)
    with pytest.raises(InvalidRequestError) as ei:
        await collect(eng, "bad", _prompt(5, 1000), max_new_tokens=2, stop=stop)
    assert (ei.value.status, ei.value.param) == (400, "stop")
    assert ei.value.message == "stop takes at most 16 strings of at most 1024 bytes each, 4096 bytes in all."
    assert eng.pool_stats()["used_pages"] == 0


async def test_a_stop_list_at_the_caps_is_served(make_engine):
    eng = await make_engine(**SMALL)
    stop = ["\x00" + "z" * 254] * 16  # 16 strings of 255 bytes: 4,080 in all, never produced
    tokens, _, last = await collect(eng, "ok", _prompt(5, 1000), max_new_tokens=4, ignore_eos=True, stop=stop)
    assert len(tokens) == 4 and last.finish_reason == "length"


def test_the_engine_caps_stop_as_the_gateway_does():
    """The engine refuses no stop list that the gateway admits, and admits none it refuses."""
    assert (sampling.MAX_STOPS, sampling.MAX_STOP_BYTES, sampling.MAX_STOP_TOTAL_BYTES) == (
        checks.MAX_STOPS,
        checks.MAX_STOP_BYTES,
        checks.MAX_STOP_TOTAL_BYTES,
    )
