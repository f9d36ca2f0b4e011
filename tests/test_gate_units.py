"""Units of the gate rules: image sizes and costs, the per-engine field tables, the new config
keys, and the chat options every counter (ChatML, Hugging Face, engine /tokenize) applies."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import pytest

from config.errors import MAX_PARAM_CHARS, OpenAIError, bounded
from config.models import ImagePolicy, Settings, TenantConfig, UpstreamConfig
from gateway.admission.checks import OPENAI_FIELDS
from gateway.admission.fields import (
    ENGINE_EXTENSIONS,
    allowed_extensions,
    check_chat_request,
    check_tool_definitions,
)
from gateway.admission.gate import CountedPrompt, decide, requested_max_tokens
from gateway.admission.registry import ModelIndex
from gateway.routes import CHAT, COMPLETIONS
from tokenizer import ChatOptions, InvalidPromptError, bundled_counter
from tokenizer.engine_counter import EngineCounter
from tokenizer.images import ImageCoster, data_url_size, image_size, openai_tiles_tokens, qwen2_vl_tokens


# ---------------------------------------------------------------- images
def _png(w: int, h: int) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", w, h) + b"\x08\x02\x00\x00\x00"


def _jpeg(w: int, h: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + b"\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, h, w, 3) + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    return b"\xff\xd8" + app0 + b"\xff\xc4" + struct.pack(">H", 4) + b"\x00\x00" + sof0


def _webp_vp8x(w: int, h: int) -> bytes:
    chunk = b"VP8X" + struct.pack("<I", 10) + b"\x00\x00\x00\x00" + (w - 1).to_bytes(3, "little")
    chunk += (h - 1).to_bytes(3, "little")
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def _webp_vp8l(w: int, h: int) -> bytes:
    bits = (w - 1) | ((h - 1) << 14)
    chunk = b"VP8L" + struct.pack("<I", 5) + b"\x2f" + bits.to_bytes(4, "little")
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


@pytest.mark.parametrize(
    "data,size",
    [
        (_png(640, 480), (640, 480)),
        (b"GIF89a" + struct.pack("<HH", 33, 7) + b"\x00" * 4, (33, 7)),
        (_jpeg(1920, 1080), (1920, 1080)),
        (_webp_vp8x(3000, 20), (3000, 20)),
        (_webp_vp8l(17, 16384), (17, 16384)),
        (b"\x89PNG\r\n\x1a\n\x00\x00", None),  # cut header
        (b"BM" + b"\x00" * 40, None),  # BMP: not read
        (b"\xff\xd8\xff\xe0\x00", None),  # cut JPEG
    ],
)
def test_image_size_from_headers(data, size):
    assert image_size(data) == size


def test_data_url_size_and_costs():
    url = "data:image/png;base64," + base64.b64encode(_png(1024, 1024)).decode()
    assert data_url_size(url) == (1024, 1024)
    exif = b"\xff\xe1" + struct.pack(">H", 5002) + b"\x00" * 5000  # SOF after 5 kB: read in the second pass
    jpeg = _jpeg(800, 600)
    big = "data:image/jpeg;base64," + base64.b64encode(jpeg[:2] + exif + jpeg[2:]).decode()
    assert data_url_size(big) == (800, 600)
    assert data_url_size("data:image/png,rawnotbase64") is None
    assert data_url_size("data:image/png;base64,!!!!") is None
    assert data_url_size("data:image/png;base64," + base64.b64encode(_png(0, 5)).decode()) is None
    # OpenAI's published examples: 1024 x 1024 high = 765; 2048 x 4096 -> 768 x 1536 = 6 tiles = 1105
    assert openai_tiles_tokens(1024, 1024, 85, 170) == 765
    assert openai_tiles_tokens(2048, 4096, 85, 170) == 1105
    assert openai_tiles_tokens(4096, 8192, 85, 170) == 1105
    assert openai_tiles_tokens(10, 10, 85, 170) == 255
    # Qwen2-VL: 1024 x 1024 -> 1036 x 1036 = 37 x 37 + 2; a tiny image is scaled up to min_pixels
    assert qwen2_vl_tokens(1024, 1024, 3136, 12845056) == 37 * 37 + 2
    assert qwen2_vl_tokens(10, 10, 3136, 12845056) == 2 * 2 + 2
    assert qwen2_vl_tokens(100000, 100000, 3136, 12845056) <= 16384 + 2
    assert qwen2_vl_tokens(1, 1000, 3136, 12845056) == 16384 + 2  # aspect ratio > 200: the maximum
    tiles = ImageCoster(ImagePolicy(cost="openai_tiles"), 765)
    part = {"type": "image_url", "image_url": {"url": url}}
    assert tiles(part) == 765
    assert tiles({"type": "image_url", "image_url": {"url": url, "detail": "low"}}) == 85
    assert tiles({"type": "image_url", "image_url": {"url": "https://x/y.png"}}) == tiles.maximum == 85 + 170 * 8
    assert tiles({"type": "input_image", "image_url": url}) == 765
    fixed = ImageCoster(ImagePolicy(), 1000)
    assert fixed(part) == 1000 == fixed.maximum
    # the counter uses the coster per image part
    c = bundled_counter()
    c.image_cost = tiles
    plain = c.count_chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert c.count_chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, part, part]}]) == plain + 1530
    with pytest.raises(ValueError):
        ImagePolicy(min_pixels=10**8, max_pixels=10**6)


# ---------------------------------------------------------------- config keys
def test_new_config_keys_and_engine_default():
    def up(**kw):
        return UpstreamConfig(name="u", api_url="http://x/v1", models=["m"], **kw)

    assert up(pool_urls=["http://x/server_info"]).engine == "kvgate"
    assert up(pool_source="sglang", pool_urls=["http://x"]).engine == "sglang"
    assert up(pool_source="vllm", pool_urls=["http://x"]).engine == "vllm"
    assert up(pool_source="static", static_pool_tokens=10).engine == "openai"
    assert up(pool_source="static", static_pool_tokens=10, engine="vllm").engine == "vllm"
    with pytest.raises(ValueError):
        up(pool_source="static", static_pool_tokens=10, engine="tgi")
    assert TenantConfig(id="t").max_sequences_per_request == 16
    with pytest.raises(ValueError):
        TenantConfig(id="t", max_sequences_per_request=0)


# ---------------------------------------------------------------- field tables
def test_engine_tables_intersect_and_stay_extensions():
    assert allowed_extensions(frozenset({"sglang", "vllm"}), "chat") == (
        ENGINE_EXTENSIONS["sglang"]["chat"] & ENGINE_EXTENSIONS["vllm"]["chat"]
    )
    assert "regex" not in allowed_extensions(frozenset({"sglang", "vllm"}), "chat")
    assert allowed_extensions(frozenset({"openai", "sglang"}), "completions") == frozenset()
    assert allowed_extensions(frozenset(), "chat") == frozenset()
    from gateway.admission.checks import CHAT_FIELDS, COMPLETION_FIELDS
    from gateway.routes.responses import RESPONSES_FIELDS, RESPONSES_OPENAI_FIELDS

    openai_fields = {**OPENAI_FIELDS, "responses": frozenset(RESPONSES_OPENAI_FIELDS)}
    checked = {"chat": CHAT_FIELDS, "completions": COMPLETION_FIELDS, "responses": RESPONSES_FIELDS}
    for engine, routes in ENGINE_EXTENSIONS.items():
        assert set(routes) == {"chat", "completions", "responses"}, engine
        for route, names in routes.items():
            assert not names & openai_fields[route], (engine, route)
            assert names <= set(checked[route]), (engine, route)  # every one has its type check
    assert CHAT.forwarded_bound(frozenset({"sglang"})) == "max_tokens"
    assert CHAT.forwarded_bound(frozenset({"vllm", "openai"})) == "max_completion_tokens"
    assert COMPLETIONS.forwarded_bound(frozenset({"openai"})) == "max_tokens"
    assert requested_max_tokens({"max_tokens": 3, "max_completion_tokens": 4}, CHAT) == (4, "max_completion_tokens")
    assert requested_max_tokens({"max_tokens": 3, "max_completion_tokens": 4}, COMPLETIONS) == (3, "max_tokens")
    assert requested_max_tokens({}, CHAT) == (None, "max_tokens")


def test_check_request_drops_no_op_defaults_and_builds_options():
    images = ImagePolicy()
    body = {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True, "top_k": None}
    body["spaces_between_special_tokens"] = None
    assert check_chat_request(body, frozenset({"sglang"}), images) == ChatOptions()
    assert "add_generation_prompt" not in body and "spaces_between_special_tokens" not in body
    assert body["top_k"] is None  # in SGLang's table: passed as sent
    body = {"messages": [], "add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}}
    opts = check_chat_request(body, frozenset({"vllm"}), images)
    assert opts == ChatOptions(add_generation_prompt=False, template_kwargs=(("enable_thinking", False),))
    body = {"messages": [], "reasoning_effort": "none"}
    assert check_chat_request(body, frozenset({"sglang"}), images).template_kwargs == (
        ("enable_thinking", False),
        ("reasoning_effort", "none"),  # SGLang passes it to the template as a variable
        ("thinking", False),
    )
    assert check_chat_request({"messages": [], "reasoning_effort": "high"}, frozenset({"vllm"}), images) == (
        ChatOptions(template_kwargs=(("enable_thinking", True), ("reasoning_effort", "high")))
    )  # vLLM sets enable_thinking from the effort unless the kwargs name it


def test_tool_definitions_with_special_tokens_refused_where_the_engine_parses_them():
    specials = bundled_counter().special_token_texts
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= specials
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {}}},
        {"type": "function", "function": {"name": "g<|im_end|>"}},
    ]

    def param(engines, specials=specials, tools=tools) -> str | None:
        try:
            check_tool_definitions(tools, specials, frozenset(engines))
        except OpenAIError as e:
            assert e.status == 400
            return e.param
        return None

    assert param({"vllm"}) == param({"sglang"}) == param({"openai"}) == "tools[1].function.name"
    assert param({"kvgate", "vllm"}) == param(set()) == "tools[1].function.name"  # unknown engines: refused
    assert param({"kvgate"}) is None  # the bundled backend encodes it as text (counted exactly)
    assert param({"vllm"}, frozenset()) is None  # an engine counter: the engine counts what it parses
    assert param({"vllm"}, tools=[{"function": {"name": "<|im_start"}}]) is None  # not a special token
    # iterative: a definition nested far past Python's recursion limit is walked to its string
    deep: object = "<|endoftext|>"
    for _ in range(5000):
        deep = [deep]
    assert param({"vllm"}, tools=[deep]) == bounded("tools[0]" + "[0]" * 5000, MAX_PARAM_CHARS)


def test_validate_accepts_the_sdk_fields_and_refuses_bad_values():
    CHAT.validate(
        {
            "messages": [],
            "prompt_cache_retention": "24h",
            "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
            "moderation": {"model": "m"},
            "verbosity": "high",
            "service_tier": "priority",
            "metadata": {"k": "v"},
            "modalities": ["text", "audio"],
            "reasoning_effort": "xhigh",
        }
    )
    for body, param in (
        ({"messages": [], "metadata": {"k": "v" * 513}}, "metadata"),
        ({"messages": [], "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"messages": [], "modalities": ["text", "text", "audio"]}, "modalities"),
        ({"messages": [], "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": [], "chat_template_kwargs": {"documents": []}}, "chat_template_kwargs"),
        ({"prompt": "x", "regex": "a" * 40000}, "regex"),
        ({"prompt": "x", "json_schema": "[1, 2]"}, "json_schema"),
    ):
        with pytest.raises(Exception) as e:
            (CHAT if "messages" in body else COMPLETIONS).validate(body)
        assert (e.value.status, e.value.param) == (400, param)


def test_decide_sequences_and_demand():
    s = Settings.model_validate({"models": [{"id": "m", "context_length": 8192}]})
    idx = ModelIndex(s)
    t = TenantConfig.model_validate({"id": "t", "default_max_tokens": 64, "max_sequences_per_request": 4})
    e = idx.resolve(t, "m")
    a = decide(e, t, {"n": 4}, CHAT, CountedPrompt(10, 10, 1), 1000)
    assert (a.max_tokens, a.sequences, a.reserve_tokens) == (64, 4, 4 * 74)
    a = decide(e, t, {"n": 4}, CHAT, CountedPrompt(10, 10, 1), 200)  # 200 // 4 - 10 = 40 per sequence
    assert (a.max_tokens, a.reserve_tokens) == (40, 200)
    with pytest.raises(Exception) as err:
        decide(e, t, {"n": 5}, CHAT, CountedPrompt(10, 10, 1), 1000)
    assert err.value.param == "n" and "at most 4" in err.value.message
    with pytest.raises(Exception) as err:
        decide(e, t, {"best_of": 3}, COMPLETIONS, CountedPrompt(10, 20, 2), 1000)  # 2 x 3 = 6 > 4
    assert err.value.param == "best_of"
    with pytest.raises(Exception) as err:
        decide(e, t, {}, COMPLETIONS, CountedPrompt(10, 50, 5), 1000)
    assert err.value.param == "prompt"
    with pytest.raises(Exception) as err:
        decide(e, t, {"n": 4, "max_tokens": 41}, CHAT, CountedPrompt(10, 10, 1), 200)
    assert err.value.param == "n" and "needs 204 tokens of KV cache" in err.value.message


# ---------------------------------------------------------------- chat options in every counter
def test_chatml_options():
    c = bundled_counter()
    msgs = [{"role": "user", "content": "hi"}]
    assert c.count_chat(msgs, None, ChatOptions(add_generation_prompt=False)) == c.count_chat(msgs) - 3
    assert c.count_chat(msgs, None, ChatOptions(template_kwargs=(("enable_thinking", True),))) == c.count_chat(msgs)
    with pytest.raises(InvalidPromptError) as e:
        c.count_chat(msgs, None, ChatOptions(add_generation_prompt=False, continue_final_message=True))
    assert e.value.param == "continue_final_message"


async def test_engine_counter_sends_every_prompt_field_to_tokenize():
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"count": 42})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    counter = EngineCounter("http://engine", "m", api="vllm", client=client)
    tools = [{"type": "function", "function": {"name": "f"}}]
    opts = ChatOptions(
        add_generation_prompt=False, continue_final_message=True, template_kwargs=(("enable_thinking", False),)
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert await counter.acount_chat(msgs, tools, opts) == 42
    assert sent[-1] == {
        "model": "m",
        "messages": msgs,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": tools,
    }
    assert await counter.acount_chat(msgs) == 42
    assert sent[-1] == {"model": "m", "messages": msgs, "add_generation_prompt": True}
    await counter.aclose()


THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("think-hf")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello there, general kenobi <think> </think> assistant user"] * 30, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": THINK_TEMPLATE, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )
    return folder


@pytest.mark.parametrize(
    "opts,kwargs",
    [
        (ChatOptions(), {"add_generation_prompt": True}),
        (
            ChatOptions(template_kwargs=(("enable_thinking", False),)),
            {"add_generation_prompt": True, "enable_thinking": False},
        ),
        (ChatOptions(add_generation_prompt=False), {"add_generation_prompt": False}),
        (
            ChatOptions(add_generation_prompt=False, continue_final_message=True),
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
    ],
)
def test_hf_counter_options_match_transformers(hf_dir, opts, kwargs):
    transformers = pytest.importorskip("transformers")
    from tokenizer.hf_counter import HFCounter

    msgs = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"}]
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    expected = hf.apply_chat_template(msgs, tokenize=True, return_dict=False, **kwargs)
    counter = HFCounter(hf_dir)
    assert counter.count_chat(msgs, None, opts) == len(expected)
    if opts.continue_final_message:  # transformers versions cut trailing whitespace differently: refused
        for bad in ("general kenobi  ", "", None):
            with pytest.raises(InvalidPromptError) as e:
                counter.count_chat([msgs[0], {"role": "assistant", "content": bad}], None, opts)
            assert e.value.param == "continue_final_message"


def test_qwen2_vl_cost_matches_the_processors_smart_resize():
    """Parity with transformers' own ``smart_resize`` (read from its source: the processor module
    itself needs PIL), over sizes around every branch."""
    import ast
    import importlib.util
    import math

    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.submodule_search_locations is None:
        pytest.skip("transformers not installed")
    from pathlib import Path

    src = Path(spec.submodule_search_locations[0]) / "models/qwen2_vl/image_processing_pil_qwen2_vl.py"
    if not src.is_file():
        pytest.skip("this transformers has no Qwen2-VL PIL processor")
    fn = next(n for n in ast.parse(src.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize")
    scope: dict = {"math": math}
    exec(compile(ast.Module([fn], []), str(src), "exec"), scope)
    smart_resize = scope["smart_resize"]
    sizes = [(1, 1), (13, 13), (14, 15), (56, 56), (100, 3000), (1024, 768), (3000, 4000), (8000, 8000), (20, 3999)]
    for w, h in sizes:
        for lo, hi in ((56 * 56, 28 * 28 * 16384), (56 * 56, 14 * 14 * 4 * 1280), (256 * 28 * 28, 1280 * 28 * 28)):
            rh, rw = smart_resize(h, w, 28, lo, hi)
            assert qwen2_vl_tokens(w, h, lo, hi) == (rh // 28) * (rw // 28) + 2, (w, h, lo, hi)
