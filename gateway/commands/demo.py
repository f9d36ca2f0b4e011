"""``kvgate demo``: the embedded stack on real input.

Starts the stack (as ``kvgate up``), reads the tenant's effective limit from the gateway's
``GET /v1/models`` (``max_model_len``) and the prefill pool from the backend's ``/server_info``,
then sends real text (:mod:`gateway.stack.demo_corpus`: public-domain prose, kvgate's own source, a
generated log) as chat and as completion, streamed and not, at four sizes:

==================  ===========================================  ==================================
size                prompt tokens                                expected answer
==================  ===========================================  ==================================
short               a few dozen                                  200
at limit            ``limit - max_tokens`` (exactly at the gate)  200
limit + 1           one token over                               400 ``context_length_exceeded``
> prefill pool      ``pool + 1`` (the runbook's incident prompt)  400 ``context_length_exceeded``
==================  ===========================================  ==================================

and prints a table: request, prompt tokens, effective limit, status, latency, result. Exit status:
0 when every answer is the expected one, 1 otherwise (or when the stack fails). Without
``--once`` the stack then keeps serving until Ctrl-C.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import httpx
import orjson

from config.loader import ConfigError
from config.models import TokenizerConfig
from gateway.commands.up import add_stack_arguments, banner, effective_limit, stack_options, start_stack
from gateway.stack.demo_corpus import fit_chat, fit_prompt, generated_log, project_source, prose
from gateway.stack.embedded import (
    BUILTIN_MODELS,
    DEMO_KEYS,
    EmbeddedStack,
    StackError,
    serve_until_interrupted,
    terminate_as_interrupt,
)
from tokenizer import PromptCounter, bundled_counter, make_counter

#: The demo's pools for a real model (``--prefill-max-total-tokens`` / ``--decode-max-total-tokens``):
#: small, so its at-limit prompts (limit = 1024 / 1.25 = 819 tokens) prefill in seconds on 2 CPU cores.
REAL_MODEL_POOLS = (1024, 4096)
#: The short chat question every demo run asks (a real model answers it with real text).
QUESTION = "What is the capital of France?"


@dataclass(frozen=True)
class Endpoint:
    """An endpoint the demo sends to: ``name`` (the table's label), ``path``, ``chat`` (the
    answer's text is each choice's ``message``/``delta`` content; else its ``text``)."""

    name: str
    path: str
    chat: bool

    def text_of(self, choice: dict[str, Any]) -> str | None:
        """The text one choice of a whole answer or stream chunk adds."""
        if self.chat:
            return (choice.get("message") or choice.get("delta") or {}).get("content")
        return choice.get("text")


CHAT = Endpoint("chat", "/v1/chat/completions", chat=True)
COMPLETION = Endpoint("completion", "/v1/completions", chat=False)


@dataclass
class Case:
    """One demo request: ``endpoint`` is :data:`CHAT` or :data:`COMPLETION`; ``body`` the JSON
    sent (without ``model``/``stream``); ``prompt_tokens`` the count it was built to; ``expect``
    the status (and for 400 the error code) the gateway must answer."""

    endpoint: Endpoint
    size: str
    stream: bool
    body: dict[str, Any]
    prompt_tokens: int
    expect_status: int
    expect_code: str | None = None

    @property
    def label(self) -> str:
        """``chat stream  at limit`` style name of the request."""
        return f"{self.endpoint.name:<10} {'streamed' if self.stream else 'whole':<8} {self.size}"


@dataclass
class Result:
    """What came back: HTTP ``status``, ``latency_ms`` (request sent -> last byte), the error
    ``code`` and ``message`` (non-200), ``text`` and ``finish_reason``/``usage`` (200)."""

    case: Case
    status: int
    latency_ms: float
    code: str | None = None
    message: str | None = None
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the answer is the expected one (for 200: the engine counted the same prompt tokens)."""
        if self.status != self.case.expect_status or self.code != self.case.expect_code:
            return False
        if self.status == 200 and self.usage and self.usage.get("prompt_tokens") != self.case.prompt_tokens:
            return False
        return True


@dataclass(frozen=True)
class Size:
    """One size of the demo (a row of the module's table): ``name``; what its prompts are cut to,
    ``over`` tokens beyond ``base`` (``"limit"``: the limit less ``max_tokens``; ``"pool"``: the
    prefill pool; ``""``: not cut, a short prompt); the status (and error code) expected."""

    name: str
    base: str
    over: int
    expect_status: int
    expect_code: str | None = None

    def target(self, limit: int, pool_tokens: int, max_tokens: int) -> int:
        """The prompt tokens this size's prompts are cut to."""
        return (limit - max_tokens if self.base == "limit" else pool_tokens) + self.over


#: The demo's sizes, in the table's order; each is sent as chat and as completion, whole and streamed.
SIZES = (
    Size("short", "", 0, 200),
    Size("at limit", "limit", 0, 200),
    Size("limit + 1", "limit", 1, 400, "context_length_exceeded"),
    Size("> prefill pool", "pool", 1, 400, "context_length_exceeded"),
)


@dataclass(frozen=True)
class _Texts:
    """The demo's sources (:mod:`gateway.stack.demo_corpus`): two prose passages, kvgate's source, a log."""

    moby: str
    poems: str
    code: str
    log: str

    @classmethod
    def load(cls, pool_tokens: int) -> _Texts:
        text = prose()
        return cls(
            text[text.index("Call me Ishmael") :],
            text[text.index("Litwo!") :],
            project_source(),
            generated_log(max(400, pool_tokens // 20)),
        )


class _Prompts(NamedTuple):
    """A size's chat ``messages`` and completion ``prompt``, with the prompt tokens of each."""

    messages: list[dict[str, Any]]
    chat_tokens: int
    prompt: str
    prompt_tokens: int


def _short_prompts(texts: _Texts, stream: bool, counter: PromptCounter) -> _Prompts:
    """A question (streamed: a summary of a paragraph) and a passage to continue, as they count."""
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {
            "role": "user",
            "content": ("Summarise in one sentence:\n\n" + texts.moby.split("\n\n")[0]) if stream else QUESTION,
        },
    ]
    prompt = "Continue this passage:\n\n" + (texts.poems if stream else texts.moby.split("\n\n")[1])
    return _Prompts(messages, counter.count_chat(messages), prompt, counter.count_text(prompt))


def _cut_prompts(texts: _Texts, over_pool: bool, target: int, counter: PromptCounter) -> _Prompts:
    """Prompts of exactly ``target`` tokens. Chat: prose and kvgate's source (over the pool: the
    last two thirds of the source); completion: kvgate's source (over the pool: the log)."""
    source_chat = texts.code[len(texts.code) // 3 :] if over_pool else (texts.moby + "\n\n" + texts.code)
    messages = fit_chat(
        source_chat,
        target,
        counter,
        system="You review Python code.",
        instruction="Explain what this text and code do:\n\n",
    )
    prompt = fit_prompt(texts.log if over_pool else texts.code, target, counter)
    return _Prompts(messages, target, prompt, target)


def build_cases(limit: int, pool_tokens: int, max_tokens: int, counter: PromptCounter | None = None) -> list[Case]:
    """The 16 requests of the demo (see the module docstring): each of :data:`SIZES` as chat and
    as completion, whole and streamed (chat first, whole first), their prompts built to exact
    token counts with ``counter`` (the served model's tokenizer, as the gateway counts; default the
    bundled one). Raises ``ValueError`` when ``limit <= max_tokens + 32``."""
    if limit <= max_tokens + 32:
        raise ValueError(f"the effective limit ({limit}) leaves no room for a prompt beside max_tokens={max_tokens}")
    counter = counter or bundled_counter()
    texts = _Texts.load(pool_tokens)
    chat: list[Case] = []
    completion: list[Case] = []
    for stream in (False, True):
        for size in SIZES:
            if size.base:
                target = size.target(limit, pool_tokens, max_tokens)
                p = _cut_prompts(texts, size.base == "pool", target, counter)
            else:
                p = _short_prompts(texts, stream, counter)
            sent = {"max_tokens": max_tokens, "temperature": 0}
            expect = (size.expect_status, size.expect_code)
            chat.append(Case(CHAT, size.name, stream, {"messages": p.messages, **sent}, p.chat_tokens, *expect))
            completion.append(
                Case(COMPLETION, size.name, stream, {"prompt": p.prompt, **sent}, p.prompt_tokens, *expect)
            )
    return chat + completion


def send(client: httpx.Client, base_url: str, key: str, model: str, case: Case) -> Result:
    """Send one case through the gateway; streams are read to the end (``data: [DONE]``)."""
    body = {"model": model, **case.body, "stream": case.stream}
    if case.stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    t0 = time.perf_counter()
    with client.stream("POST", base_url + case.endpoint.path, content=orjson.dumps(body), headers=headers) as r:
        raw = r.read()
    latency_ms = (time.perf_counter() - t0) * 1000
    res = Result(case, r.status_code, latency_ms)
    if r.status_code != 200:
        try:
            err = orjson.loads(raw).get("error", {})
        except (orjson.JSONDecodeError, AttributeError):
            err = {}
        res.code, res.message = err.get("code"), err.get("message") or raw[:200].decode("utf-8", "replace")
        return res
    chunks = (
        [orjson.loads(raw)]
        if not case.stream
        else [
            orjson.loads(line[6:])
            for line in raw.split(b"\n")
            if line.startswith(b"data: ") and line != b"data: [DONE]"
        ]
    )
    for chunk in chunks:
        if chunk.get("usage"):
            res.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            res.text += case.endpoint.text_of(choice) or ""
            res.finish_reason = choice.get("finish_reason") or res.finish_reason
    return res


def table(results: list[Result], limit: int) -> str:
    """The demo's table (fixed-width text)."""
    head = f"{'request':<34} {'prompt tokens':>13} {'limit':>6} {'status':>6} {'latency ms':>10}  result"
    lines = [head, "-" * (len(head) + 40)]
    for r in results:
        if r.status == 200:
            used = r.usage.get("completion_tokens", "?")
            result = f"{r.finish_reason}, {used} completion tokens: {r.text.strip()[:48]!r}"
        else:
            result = f"{r.code}" if r.code else (r.message or "")[:60]
        mark = (
            ""
            if r.ok
            else "   <-- expected "
            + (
                f"{r.case.expect_status} {r.case.expect_code or ''}".strip()
                if r.status != r.case.expect_status or r.code != r.case.expect_code
                else f"usage.prompt_tokens {r.case.prompt_tokens}"
            )
        )
        lines.append(
            f"{r.case.label:<34} {r.case.prompt_tokens:>13} {limit:>6} {r.status:>6} "
            f"{r.latency_ms:>10.1f}  {result}{mark}"
        )
    return "\n".join(lines)


def run_demo(
    stack: EmbeddedStack, *, key: str = DEMO_KEYS["demo-a"], max_tokens: int = 16, out: Callable[[str], None] = print
) -> list[Result]:
    """Send the demo's requests through a running stack and print the table with ``out``.
    Returns the results (tests check them). Raises ``httpx.HTTPError`` when the gateway is
    unreachable and ``StackError`` when it reports no limit."""
    limit = effective_limit(stack, key)
    if limit is None:
        raise StackError(f"the gateway's /v1/models does not list {stack.model} with a max_model_len")
    pool = int(stack.server_info["max_total_num_tokens"])
    headroom = stack.settings.pool.headroom if stack.settings is not None else 1.25
    out(
        f"effective limit for this tenant: {limit} tokens (gateway /v1/models max_model_len; the pool's share is "
        f"floor({pool:,} / headroom {headroom:g}) = {math.floor(pool / headroom)}); "
        f"prefill pool: {pool} tokens (backend /server_info max_total_num_tokens); max_tokens={max_tokens}"
    )
    served = stack.served
    if served is not None and served.folder is not None:
        counter: PromptCounter = make_counter(TokenizerConfig(kind="hf", path=str(served.folder)))
        out(f"model {stack.model} ({served.folder}): real weights, its own tokenizer and chat template.\n")
    else:
        counter = bundled_counter()
        out(
            f"model {stack.model} (bundled backend): with random weights its text is noise; what matters is "
            "which requests reach it.\n"
        )
    results = []
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0), trust_env=False) as client:
        for case in build_cases(limit, pool, max_tokens, counter):
            results.append(send(client, stack.gateway_url, key, stack.model, case))
    out(table(results, limit))
    over = next((r for r in results if r.case.size == "limit + 1" and r.message), None)
    if over is not None:
        out(
            f"\nthe gateway's answer to one token over the limit ({over.case.label.split()[0]}):\n  "
            f"{over.status} {over.code}: {over.message}"
        )
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvgate demo``: those of ``kvgate up`` plus ``--once`` and ``--max-tokens``."""
    add_stack_arguments(parser)
    parser.add_argument("--once", action="store_true", help="stop the stack after the table instead of serving on")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (default 16)")
    parser.add_argument(
        "--incident",
        action="store_true",
        help="instead: the runbook's incident (engine faults on, gate mis-set) and kvgate's defences, "
        "as a table (gateway/commands/incident.py)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 when every request got its expected answer."""
    if args.incident:
        from gateway.commands.incident import main as incident_main

        return incident_main()
    with terminate_as_interrupt():
        stack: EmbeddedStack | None = None
        try:
            options = stack_options(args)
            if options.model not in BUILTIN_MODELS and not any("max-total-tokens" in a for a in options.backend_args):
                options.backend_args = [
                    f"--prefill-max-total-tokens={REAL_MODEL_POOLS[0]}",
                    f"--decode-max-total-tokens={REAL_MODEL_POOLS[1]}",
                    *options.backend_args,
                ]
            stack = start_stack(options, "kvgate demo")
            results = run_demo(stack, max_tokens=args.max_tokens)
            bad = [r for r in results if not r.ok]
            if bad:
                print(
                    f"\nkvgate demo: FAILED: {len(bad)} of {len(results)} requests did not get the expected "
                    "answer (marked above).",
                    flush=True,
                )
            else:
                print(
                    f"\nkvgate demo: OK: all {len(results)} requests got the expected answer: prompts up to the "
                    "limit were served, and one token over it or larger than the prefill pool got an explicit "
                    "400 context_length_exceeded at the edge.",
                    flush=True,
                )
            if args.once:
                return 1 if bad else 0
            print(banner(stack, effective_limit(stack, DEMO_KEYS["demo-a"])), flush=True)
            status = serve_until_interrupted(stack)
            return status or (1 if bad else 0)
        except KeyboardInterrupt:
            print("kvgate demo: interrupted", file=sys.stderr)
            return 130
        except (StackError, ConfigError, httpx.HTTPError, ValueError) as e:
            print(f"kvgate demo: {e}", file=sys.stderr)
            return 1
        finally:
            if stack is not None:
                stack.stop()
                print("kvgate demo: stack stopped.", file=sys.stderr, flush=True)
