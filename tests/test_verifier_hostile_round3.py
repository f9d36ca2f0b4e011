"""Hostile engines and tenants against the verifier, round 3: leaks an engine hands back in
another Unicode form or with other whitespace (the leak index shingles folded text), and a
regular tenant's canary framing the periodic probe into quarantining an honest upstream."""

from __future__ import annotations

import json
import random
import re
import sys
import unicodedata
import uuid
from functools import partial

import httpx
import pytest
from conftest import SEEDS

from config.models import TenantConfig
from tests.fixtures.settings import verifier_settings
from verifier.build import build_verifier
from verifier.probe import ProbeTarget, run_probe
from verifier.shingles import _COMPOSES_BACK, IncrementalShingler, ShingleHasher, encode, fold
from verifier.stage import Exchange, ExchangeRequest, ResponseWithheld

SECRETS = {"leak_index_key": b"round3-test-key", "cache_salt_key": b"x", "admin_key": b"y"}
settings = partial(verifier_settings, latency_min_samples=5, latency_min_prompt_tokens=100)
SEED_PL = (SEEDS / "001_85707760a0179a93.txt").read_text()
CANARY = re.compile(r"KVGATE-CANARY-[0-9a-f]{16}")


def tenant(tid: str, **kw) -> TenantConfig:
    return TenantConfig(id=tid, verify_sample_rate=1.0, **kw)


A, STRICT, HONEYPOT = tenant("a"), tenant("s", strict_verify=True), tenant("hp", honeypot=True)


def ex(t: TenantConfig, prompt: str, *, stream: bool = False) -> Exchange:
    request = ExchangeRequest(f"req-{uuid.uuid4().hex[:8]}", t, "up", "m", len(encode(prompt)), stream, 0.0)
    return Exchange(request, prompt)


def sse(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


def _wrapped(text: str, width: int = 60) -> str:
    """``text`` (Polish prose) with its lines wrapped at ``width`` and two spaces after every
    sentence: how a person's pasted document often looks."""
    words = " ".join(text.split()).replace(". ", ".  ").split(" ")
    lines, line = [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    return "\r\n".join([*lines, line])


VICTIM = SEED_PL[:4000]
_VI = (
    "Tiếng Việt là ngôn ngữ của người Việt và là ngôn ngữ chính thức tại Việt Nam. Những người dân ở đây"
    " thường nói rằng họ yêu quê hương đất nước mình hơn tất cả mọi điều khác trên đời"
).split()
#: Vietnamese, a diacritic in nearly every word: its NFD and NFC forms share hardly a token
_RNG = random.Random(3)
VICTIM_VI = " ".join(_RNG.choice(_VI) for _ in range(700))
# (the victim's prompt as sent, the same text as a broken engine hands it to another tenant)
FORMS = {
    # a tokenizer with an NFC normalizer (Qwen2's tokenizer.json) turns a macOS NFD text into NFC
    "nfd_prompt_nfc_answer": (unicodedata.normalize("NFD", VICTIM_VI), VICTIM_VI),
    "nfc_prompt_nfd_answer": (VICTIM_VI, unicodedata.normalize("NFD", VICTIM_VI)),
    # the model re-wraps a pasted document: one space between sentences, LF, other line breaks
    "rewrapped": (_wrapped(VICTIM), " ".join(VICTIM.split())),
    # NFKC tokenizers give full-width ASCII and no-break spaces back as ASCII
    "fullwidth_answer": (VICTIM, "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in VICTIM)),
    "nbsp_prompt": (VICTIM.replace(" ", "\u00a0"), VICTIM),
    # invisible characters of a pasted web page that a copying model drops
    "soft_hyphens_and_zero_width": (
        re.sub(r"(\w{3})(\w{3})", "\\1\u00ad\\2", VICTIM).replace(". ", ".\u200b "),
        VICTIM,
    ),
}


@pytest.mark.parametrize("form", sorted(FORMS))
async def test_strict_body_leaking_another_form_of_a_prompt_is_withheld(tmp_path, form):
    """A whole strict answer holding a 1,500-character run of tenant a's prompt, in the form an
    engine's tokenizer or a copying model gives it back: withheld, naming tenant a (before,
    shingles of the raw code points found nothing and the answer was released)."""
    sent, leaked = FORMS[form]
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    try:
        await svc.admit(ex(A, sent))
        g = svc.begin(await _admitted(svc, ex(STRICT, "Napisz coś o pogodzie.")))
        start = leaked.index(" ", len(leaked) // 4)
        with pytest.raises(ResponseWithheld) as e:
            await g.check_body(leaked[start : start + 1500], usage=None, finish_reason="stop", ttft_seconds=None)
        assert e.value.detector == "leak_index"
        (inc,) = [i for i in svc.incidents.recent if i.detector == "leak_index"]
        assert (inc.tenant, inc.withheld, inc.confirmed, inc.evidence["source_tenant"]) == ("s", True, True, "a")
    finally:
        await svc.aclose()


async def _admitted(svc, e: Exchange) -> Exchange:
    await svc.admit(e)
    return e


async def test_strict_stream_of_an_nfd_leak_cut_between_letters_and_their_accents_is_cut(tmp_path):
    """The leak streamed in NFD three code points per event (so events end between a letter and
    its combining accent), prompt sent in NFC, with Redis stores: the stream is cut before any
    leaked character leaves (before, it streamed through whole)."""
    svc = build_verifier(
        settings(tmp_path, redis_url="redis://127.0.0.1:6379/0", strict_holdback_tokens=64),
        secrets=SECRETS,
        key_prefix=f"kvgate-test-r3-{uuid.uuid4().hex[:8]}:",
    )
    try:
        await svc.admit(ex(A, VICTIM_VI))
        g = svc.begin(await _admitted(svc, ex(STRICT, "Nói gì đó đi.", stream=True)))
        lead = "Here is an answer that talks about many different things for a while. " * 4
        leak = unicodedata.normalize("NFD", VICTIM_VI[1000:2500])
        text = lead + leak
        released: list[bytes] = []
        with pytest.raises(ResponseWithheld) as e:
            for i in range(0, len(text), 3):
                released += await g.feed(text[i : i + 3], sse(text[i : i + 3]))
        assert e.value.detector == "leak_index"
        out = "".join(json.loads(r[6:])["choices"][0]["text"] for r in released)
        assert out == lead[: len(out)]
    finally:
        await svc.aclose()


async def test_sampled_answer_with_a_rewrapped_leak_is_an_incident(tmp_path):
    """The background check (a sampled, non-strict tenant) folds alike: tenant b's answer holding
    tenant a's CRLF-wrapped, double-spaced prompt re-flowed into one paragraph is a confirmed
    leak-index incident naming a."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    svc.start()
    try:
        await svc.admit(ex(A, _wrapped(VICTIM)))
        g = svc.begin(await _admitted(svc, ex(tenant("b"), "Powiedz coś.")))
        flowed = " ".join(VICTIM.split())
        await g.check_body(flowed[800:2300], usage=None, finish_reason="stop", ttft_seconds=None)
        await svc.drain(10)
        (inc,) = [i for i in svc.incidents.recent if i.detector == "leak_index"]
        assert (inc.tenant, inc.confirmed, inc.evidence["source_tenant"]) == ("b", True, "a")
    finally:
        await svc.aclose()


TRICKY = (
    "Zażółć gęślą jaźń — don’t…\r\n\r\nｆｕｌｌ width，and ﬁne™ text\u00a0here.  Twice\u3000spaced "
    "cafe\u0301 e\u0301t க\u0bc6\u0bbeb ஒ\u0bd7x क\u093c\u0958y \u037aa \u0e33b sof\u00adt zero\u200bwidth ㄱ가\u11a8 "
)


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_folded_incremental_shingles_are_those_of_the_whole_folded_text(step):
    """A stream shingled piece by piece folds exactly as its whole text: no cut between a letter
    and a mark NFKC composes with it (Tamil ``ொ``, ``ௌ``), nor before a character NFKC makes a
    letter (``™``) or that folding drops (soft hyphen, zero-width space). The table of starters
    that compose backwards is written out (computing it costs 0.2 s at import): it must be
    this Python's."""
    computed = set()
    for cp in range(sys.maxunicode + 1):
        d = unicodedata.decomposition(chr(cp)).split()
        if len(d) == 2 and not d[0].startswith("<") and not unicodedata.combining(chr(int(d[1], 16))):
            computed.add(int(d[1], 16))
    assert set(_COMPOSES_BACK) == computed
    h = ShingleHasher(SECRETS["leak_index_key"], 4)
    text = TRICKY * 3
    inc = IncrementalShingler(h, max_pending_chars=256, folded=True)
    got: list[int] = []
    for i in range(0, len(text), step):
        got += h.hashes(inc.push(text[i : i + step]))
    got += h.hashes(inc.flush())
    whole = encode(fold(text))
    assert (got, inc.tokens_seen) == (h.hashes(whole), len(whole))


def test_fold_shapes():
    assert fold("a\r\nb\n\nc   d\te") == "a b c d\te"
    assert fold(" \t" * 3) == " \t" * 3  # tabs are squeezing's, not folding's
    assert fold("cafe\u0301 ｆｕｌｌ，\u00a0x\u200by\u00adz") == "café full, xyz"
    assert fold("plain ascii") == "plain ascii"


# -- framing the periodic probe ---------------------------------------------------------------

IMITATED = "KVGATE-CANARY-0123456789abcdef"


class Engine:
    """An honest OpenAI completions endpoint (no /tokenize) whose model, reading its own prompt's
    canaries, writes one more in their pattern in each answer that holds some."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/completions"):
            return httpx.Response(404, json={"error": {"message": "no such route"}})
        prompt = json.loads(request.content)["prompt"]
        text = f"I see codes like {IMITATED}." if CANARY.search(prompt) else "Nothing special."
        return httpx.Response(200, json={"choices": [{"index": 0, "text": text, "finish_reason": "length"}]})


async def _probe(svc):
    async with httpx.AsyncClient(transport=httpx.MockTransport(Engine())) as client:
        return await run_probe(
            client, ProbeTarget("http://engine/v1", limit=400), max_tokens=16, known=svc.prober.known
        )


async def test_a_regular_tenants_canary_does_not_frame_the_periodic_probe(tmp_path):
    """Tenant a sends the canary an honest model is likely to invent in the pattern it reads
    (registered as a's, like every canary in a prompt). The periodic probe's plant answers hold
    it: before, the registry knew it, the probe called it a leak, and its confirmed incident
    quarantined the honest upstream for every tenant's long prompts. Only canaries kvgate
    planted (the probe's, a honeypot's) are evidence there: it is unmatched."""
    svc = build_verifier(settings(tmp_path, probe_interval_seconds=3600), secrets=SECRETS, tenants=[A, HONEYPOT])
    try:
        await svc.admit(ex(A, f"Please remember {IMITATED} for me."))
        assert [m.owners for m in svc.canaries.lookup([IMITATED])] == [{"a"}]
        result = await _probe(svc)
        assert (result.outcome, result.surfaced, result.exit_code) == ("clean", 0, 0)
        assert [s.unmatched for s in result.steps] == [1, 1, 0, 1, 0]
        # a honeypot's or an earlier probe's canary still counts
        hp, old = "KVGATE-CANARY-00112233445566ff", "KVGATE-CANARY-ffeeddccbbaa0099"
        await svc.admit(ex(HONEYPOT, f"keep {hp}"))
        await svc.prober.register([old])
        assert await svc.prober.known([IMITATED, hp, old, "KVGATE-CANARY-1111111111111111"]) == [
            False,
            True,
            True,
            False,
        ]
    finally:
        await svc.aclose()


#: tenant a's prompt: code, every line shorter than a shingle (16 tokens), 60 lines
CODE = "\n".join(f"    t{i} = part({i}, w={i * 7 % 13})" for i in range(60))


@pytest.mark.parametrize("ensure_ascii", [False, True])
async def test_a_leak_inside_a_tool_calls_escaped_arguments_is_an_incident(tmp_path, ensure_ascii):
    """Tenant a's multi-line prompt handed to tenant b as a tool call's ``arguments``, a JSON
    string whose line breaks are ``\\n`` (and, from a parser serializing with ``ensure_ascii``,
    every non-ASCII character a ``\\uXXXX``): shingled as escaped text, no shingle matched across
    the escapes, and lines shorter than a shingle matched nothing. The check now also shingles
    the arguments' parsed string values, as the prompt side indexes them: a confirmed incident."""
    svc = build_verifier(settings(tmp_path), secrets=SECRETS)
    svc.start()
    try:
        await svc.admit(ex(A, "Popraw ten kod, zażółć:\n" + CODE))
        g = svc.begin(await _admitted(svc, ex(tenant("b"), "Zapisz plik.")))
        arguments = json.dumps({"path": "a.py", "content": "zażółć\n" + CODE}, ensure_ascii=ensure_ascii)
        assert "\\n" in arguments and not {s for s in CODE.split("\n") if len(encode(s)) >= 16}
        await g.check_body(["", arguments], usage=None, finish_reason="tool_calls", ttft_seconds=None)
        await svc.drain(10)
        (inc,) = [i for i in svc.incidents.recent if i.detector == "leak_index"]
        assert (inc.tenant, inc.confirmed, inc.evidence["source_tenant"]) == ("b", True, "a")
    finally:
        await svc.aclose()
