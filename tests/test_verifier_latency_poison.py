"""Latency calibration against an actor that makes its own answers SLOW (one key keeps the
engine's queue full while the other sends short prompts): it must not raise the bound of
honest long prompts. Regression tests for the reviewer's reproduction
(/tmp/verifier_review/latency_poison.py): two keys' 8 s samples on 20-token prompts lifted the
3,000-token bound from 0.201 s to 3.962 s (the bucket level was the *upper* median of 4 tenants,
and ``top`` took the level of any shorter bucket, also one below ``latency_min_prompt_tokens``),
so every tenant's honest 0.41 s answers were flagged and a strict tenant's were withheld.

Expected values are exact: a bucket's level is one tenant's DDSketch ``q(0.001)``, which
:func:`v` computes the same way (the sketch of one sample)."""

from __future__ import annotations

import time
import uuid

from ddsketch import DDSketch

from config.models import TenantConfig
from tests.fixtures.settings import verifier_settings
from verifier.build import build_verifier
from verifier.latency import LatencyModel
from verifier.stage import Exchange, ExchangeRequest

SECRETS = {"leak_index_key": b"latency-poison-test-key", "cache_salt_key": b"x", "admin_key": b"y"}


def v(seconds: float) -> float:
    """The level a tenant whose fastest sample is ``seconds`` gives a bucket (q(0.001), 1%)."""
    s = DDSketch(relative_accuracy=0.01)
    s.add(seconds)
    q = s.get_quantile_value(0.001)
    assert q is not None
    return q


def expected_bound(top: float, shorter: list[float], margin: float = 0.5) -> float:
    """The documented bound: ``floor + margin x (top - floor)``, ``floor`` the smallest shorter
    level capped at ``0.8 x top`` (0 without one)."""
    floor = min(min(shorter), 0.8 * top) if shorter else 0.0
    return floor + margin * (top - floor)


def tenant(tid: str, **kw) -> TenantConfig:
    return TenantConfig(id=tid, verify_sample_rate=1.0, **kw)


H1, H2, H3 = tenant("honest-1"), tenant("honest-2"), tenant("honest-3")
X1, X2 = tenant("attacker-key-1"), tenant("attacker-key-2")
STRICT = tenant("strict-victim", strict_verify=True)


def honest_traffic(observe) -> None:
    """The reviewer's honest traffic: 2 tenants' 20-token prompts (bucket 4) at 20-26 ms, 3
    tenants' 3,000-token prompts (bucket 11) at 0.40-0.46 s; ``observe(tenant, tokens, ttft)``."""
    for i in range(60):
        observe(("honest-1", "honest-2")[i % 2], 20, 0.020 + (i % 7) * 0.001)
        observe(("honest-1", "honest-2", "honest-3")[i % 3], 3000, 0.400 + (i % 7) * 0.01)


def attack(observe) -> None:
    """Two keys of one actor: 25 samples each of 20-token prompts answered in 8 s."""
    for _ in range(25):
        observe("attacker-key-1", 20, 8.0)
        observe("attacker-key-2", 20, 8.0)


def service_model() -> LatencyModel:
    """The service's calibration settings (min_samples 50, tenant_share 0.5, min_tenants 3,
    margin 0.5, min_prompt_tokens 512)."""
    return LatencyModel(min_samples=50, min_prompt_tokens=512, tenant_share=0.5, min_tenants=3)


def test_two_slow_keys_on_short_prompts_do_not_raise_the_long_bound():
    m = service_model()

    def observe(t, n, ttft):
        assert not m.observe("up", n, ttft, "whole", model="m", tenant=t, cached_tokens=0).anomaly

    honest_traffic(observe)
    before = m.bound("up", 3000, "whole", "m")
    assert before == expected_bound(v(0.400), []) == 0.5 * v(0.400)  # bucket 4 has 2 tenants of 3
    assert m.bound("up", 600, "whole", "m") is None
    attack(observe)
    # bucket 4 now has 4 tenants and calibrates, at its honest level (lower median of
    # [20 ms, 20 ms, 8 s, 8 s]): it gives the fixed-cost floor, and never the top
    after = m.bound("up", 3000, "whole", "m")
    assert after == expected_bound(v(0.400), [v(0.020)])
    assert m.bound("up", 20, "whole", "m") == 0.5 * v(0.020)
    assert round(before, 4) == 0.2012 and round(after, 4) == 0.2113  # was 3.962 s
    assert m.bound("up", 600, "whole", "m") is None  # was 3.962 s: no judged bucket at or below it
    # exactly what a third honest short-prompt tenant (instead of the attacker) would give
    control = service_model()
    honest_traffic(lambda t, n, ttft: control.observe("up", n, ttft, "whole", model="m", tenant=t, cached_tokens=0))
    for i in range(25):
        control.observe("up", 20, 0.020 + (i % 7) * 0.001, "whole", model="m", tenant="honest-3", cached_tokens=0)
    assert control.bound("up", 3000, "whole", "m") == after
    # honest answers as fast as before raise no anomaly, and keep calibrating
    for i in range(6):
        t = ("honest-1", "honest-2", "honest-3")[i % 3]
        assert not m.observe("up", 3000, 0.41, "whole", model="m", tenant=t, cached_tokens=0).anomaly
    assert m.samples("up", 11, "whole", "m") == 66
    # a leak is still caught
    assert m.judge("up", 3000, 0.020, "whole", model="m", cached_tokens=0).anomaly


async def test_reviewer_scenario_through_the_service_raises_no_incident_and_withholds_nothing(tmp_path):
    """The reviewer's script, through the service with its default calibration settings."""
    svc = build_verifier(verifier_settings(tmp_path), secrets=SECRETS)
    by_id = {t.id: t for t in (H1, H2, H3, X1, X2, STRICT)}

    async def sample(t: TenantConfig, n: int, ttft: float):
        r = ExchangeRequest(f"r-{uuid.uuid4().hex[:8]}", t, "up", "m", n, False, time.monotonic())
        usage = {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}
        g = svc.begin(Exchange(r, "", prompt_ids=[]))
        return await g.check_body("ok", usage=usage, finish_reason="stop", ttft_seconds=ttft)

    try:
        calls: list[tuple[str, int, float]] = []
        honest_traffic(lambda t, n, ttft: calls.append((t, n, ttft)))
        for t, n, ttft in calls:
            await sample(by_id[t], n, ttft)
        await svc.drain()
        before = svc.latency.bound("up", 3000, "whole", "m")
        assert before == 0.5 * v(0.400) and svc.incidents.recent == []
        calls = []
        attack(lambda t, n, ttft: calls.append((t, n, ttft)))
        for t, n, ttft in calls:
            await sample(by_id[t], n, ttft)
        await svc.drain()
        assert svc.latency.bound("up", 3000, "whole", "m") == expected_bound(v(0.400), [v(0.020)])
        assert svc.latency.bound("up", 600, "whole", "m") is None
        for i in range(6):
            await sample((H1, H2, H3)[i % 3], 3000, 0.41)
        for _ in range(5):  # a strict tenant's honest answers (nothing cached): released
            assert await sample(STRICT, 3000, 0.45) is None
        await svc.drain()
        assert svc.incidents.recent == []
        assert svc.latency.samples("up", 11, "whole", "m") == 60 + 6 + 5
    finally:
        await svc.aclose()


def test_lower_median_needs_a_strict_majority_of_slow_tenants():
    def level(ttfts: list[float]) -> float | None:
        m = LatencyModel(min_samples=8, min_prompt_tokens=512, tenant_share=0.5, min_tenants=3)
        for k, ttft in enumerate(ttfts):
            for _ in range(4):
                m.record("up", 3000, ttft, "whole", "m", f"t{k}")
        b = m.bound("up", 3000, "whole", "m")
        return None if b is None else b / 0.5  # one calibrated bucket: bound = 0.5 x level

    assert level([0.40, 0.40, 8.0, 8.0]) == v(0.40)  # 2 slow of 4: the level does not move
    assert level([0.40, 8.0, 8.0, 8.0]) == v(8.0)  # 3 slow of 4: it does
    assert level([0.40, 0.40, 8.0]) == v(0.40)  # odd counts: the middle one, as before
    assert level([0.40, 8.0, 8.0]) == v(8.0)
    # the other side of an even count (documented): 2 fast of 4 lower it
    assert level([0.002, 0.002, 0.40, 0.40]) == v(0.002)


def test_top_ignores_buckets_below_min_prompt_tokens():
    m = LatencyModel(min_samples=3, min_prompt_tokens=512, tenant_share=1.0, min_tenants=3)

    def calibrate(n: int, ttft: float) -> None:
        for t in ("a", "b", "c"):
            m.record("up", n, ttft, "whole", "m", t)

    calibrate(20, 8.0)  # bucket 4: slow, below the minimum
    calibrate(3000, 0.40)  # bucket 11
    # bucket 4 gives the fixed-cost floor (capped at 0.8 x top), never the top: 0.9 x 0.40 s
    assert m.bound("up", 3000, "whole", "m") == expected_bound(v(0.40), [v(8.0)])
    assert m.bound("up", 600, "whole", "m") is None  # only bucket 4 below it: uncalibrated
    assert m.bound("up", 20, "whole", "m") == 0.5 * v(8.0)  # its own bucket (never flagged)
    assert not m.judge("up", 3000, 0.39, "whole", model="m").anomaly
    # a judged shorter bucket still holds longer prompts (prefill does not shrink with length)
    calibrate(600, 0.60)  # bucket 9
    assert m.bound("up", 3000, "whole", "m") == expected_bound(v(0.60), [v(8.0)])
    assert m.bound("up", 6000, "whole", "m") == expected_bound(v(0.60), [v(8.0)])  # bucket 12: none
    assert m.bound("up", 600, "whole", "m") == expected_bound(v(0.60), [v(8.0)])


def test_cache_hits_stay_out_of_calibration():
    m = LatencyModel(min_samples=3, min_prompt_tokens=512)
    v1 = m.observe("up", 3000, 0.002, "whole", model="m", tenant="a", cached_tokens=2990)
    assert (v1.anomaly, v1.bucket, v1.cached_known) == (False, 3, True)  # judged by the 10 prefilled
    assert m.samples("up", 3, "whole", "m") == 0 and m.samples("up", 11, "whole", "m") == 0
    assert m.take_unsaved() == []
    m.observe("up", 3000, 0.40, "whole", model="m", tenant="a", cached_tokens=0)  # no hit: calibrates
    m.observe("up", 3000, 0.41, "whole", model="m", tenant="a")  # engine did not say: whole prompt
    assert m.samples("up", 11, "whole", "m") == 2
    assert [(k[3], t) for k, t, _ in m.take_unsaved()] == [(11, "a"), (11, "a")]
