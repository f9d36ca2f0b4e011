"""A Hugging Face model's images and content parts as each engine joins them before the chat
template runs, through the real app.

vLLM hands a "string"-format template (one that never loops over a message's content) each
message's content as one string (vllm/entrypoints/chat_utils.py@001eadcf
``_parse_chat_message_content_parts``): text parts joined with ``\\n``, an empty one dropped, and
with images ``_get_full_multimodal_text_prompt``: each image's placeholder in front of the text,
``\\n`` between (or in place with ``--interleave-mm-strings``). The model's processor replaces each
placeholder with the image's tokens, which the image policy costs exactly (``qwen2_vl``). kvgate's
HF counter left the images out of the joined text, so the ``\\n`` beside each placeholder went
uncounted (one token per image under the policy's exact cost), and it kept the empty parts vLLM
drops. A template that loops over content ("openai" format; for SGLang also any template naming
image, audio, video or vision) gets the parts as a list and writes each image's placeholder
itself: kvgate counts that placeholder's text on top of the image's cost (one token here), an
overcount. SGLang's "string" format drops the images from the prompt; kvgate charges them.

Models (a tiny byte-level BPE tokenizer whose ``<|image_pad|>`` is a special token, Qwen2-VL's
placeholder, which the oracle treats as the model's): ``sv``/``ss`` a ChatML "string" template
behind vLLM / SGLang, ``pv``/``ps`` a Qwen2-VL-style template that loops over content, all with
the ``qwen2_vl`` image cost, and ``svf`` the string template behind vLLM with the fixed cost (765
per image). Live limit 3,276 tokens, tenant ``max_tokens_cap`` 256. Every count is checked
against a literal and against the oracle (tests/gate_oracle.py ``hf_chat_tokens``: the engines'
steps copied from their source, rendered with ``transformers``) applied to the body the engine
received.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config.models import Settings
from tests.gate_env import mock_pair_env
from tests.gate_oracle import hf_chat_tokens, png, png_size, qwen2_vl_cost, sglang_content_format, vllm_content_format
from tests.mock_engine import MockEngine
from tests.render_env import LIMIT

#: ChatML that prints ``message['content']`` as it is: the "string" content format for both engines
STRING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Qwen2-VL-style: loops over a list content, writing the model's placeholder for each image
PARTS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|image_pad|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = "Look at this and that. Hello world, user assistant system a b c 日本語 é"
#: model -> (template folder, engine, image policy)
MODELS = {
    "sv": ("string", "vllm", {"cost": "qwen2_vl"}),
    "ss": ("string", "sglang", {"cost": "qwen2_vl"}),
    "pv": ("parts", "vllm", {"cost": "qwen2_vl"}),
    "ps": ("parts", "sglang", {"cost": "qwen2_vl"}),
    "svf": ("string", "vllm", {}),
}


def _folder(folder: Path, template: str) -> Path:
    import tokenizers

    folder.mkdir()
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>", "<|image_pad|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS] * 50, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def make_folders(root: Path) -> Path:
    _folder(root / "string", STRING_TEMPLATE)
    _folder(root / "parts", PARTS_TEMPLATE)
    return root


def settings(sg: MockEngine, vl: MockEngine, root: Path) -> Settings:
    upstreams = [
        {
            "name": "u-sglang",
            "api_url": sg.api_url,
            "pool_source": "sglang",
            "pool_urls": [sg.info_url],
            "models": [m for m, (_, e, _) in MODELS.items() if e == "sglang"],
        },
        {
            "name": "u-vllm",
            "api_url": vl.api_url,
            "pool_source": "vllm",
            "pool_urls": [vl.url + "/v1/models"],
            "models": [m for m, (_, e, _) in MODELS.items() if e == "vllm"],
        },
    ]
    models = [
        {"id": m, "context_length": 8192, "tokenizer": {"kind": "hf", "path": str(root / f)}, "images": images}
        for m, (f, _, images) in MODELS.items()
    ]
    return Settings.model_validate(
        {
            "gateway": {"max_body_bytes": 8 * 1024 * 1024, "connect_timeout_seconds": 1, "read_timeout_seconds": 5},
            "pool": {"poll_interval_seconds": 0.2, "max_staleness_seconds": 5, "request_timeout_seconds": 2.0},
            "models": models,
            "upstreams": upstreams,
            "verifier": {"enabled": False},
            "quotas": {"enabled": False},
        }
    )


@pytest.fixture(scope="module")
def env():
    with mock_pair_env(make_folders, settings) as e:
        yield e


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(width: int, height: int) -> dict:
    return {"type": "image_url", "image_url": {"url": png(width, height)}}


IMAGE = image(56, 56)  # qwen2_vl: (56 / 28) x (56 / 28) + 2 = 6 tokens


def _cost(model: str):
    if MODELS[model][2].get("cost") != "qwen2_vl":
        return None

    def cost(part: dict) -> int:
        size = png_size(part["image_url"]["url"])
        assert size is not None
        return qwen2_vl_cost(*size)

    return cost


def oracle(env, model: str, body: dict) -> int:
    root = env[4]
    folder, engine, _ = MODELS[model]
    return hf_chat_tokens(root / folder, body, engine=engine, image_cost=_cost(model))


def admitted(env, model: str, messages: list[dict], max_tokens: int = 16) -> tuple[int, int]:
    """POST the chat; asserts a 200 and one forwarded request; returns ``(kvgate's count: the
    reservation less max_tokens, the oracle's count of what the engine received)``."""
    client, sg, vl, quotas, _ = env
    before = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
    r = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    received = sg.state.requests[before[0] :] + vl.state.requests[before[1] :]
    assert len(received) == 1 and len(quotas.reserved) == before[2] + 1
    return quotas.reserved[-1] - max_tokens, oracle(env, model, received[0]["body"])


def test_the_engines_read_the_templates_formats(env):
    """The string template is "string" for both engines; the one that loops over content is
    "openai" for both (and would be for SGLang by its mention of an image alone)."""
    assert vllm_content_format(STRING_TEMPLATE) == sglang_content_format(STRING_TEMPLATE) == "string"
    assert vllm_content_format(PARTS_TEMPLATE) == sglang_content_format(PARTS_TEMPLATE) == "openai"


def test_the_oracle_renders_vllms_string(env):
    """The oracle's count for ``"Look at", image, "this", image`` behind vLLM is the template
    rendered with vLLM's string (``<|image_pad|>\\n<|image_pad|>\\nLook at\\nthis``, or in place:
    the same count here), each placeholder replaced by the image's 6 tokens."""
    import transformers

    folder = env[4] / "string"
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    counts = []
    for vllm_text in ("<|image_pad|>\n<|image_pad|>\nLook at\nthis", "Look at\n<|image_pad|>\nthis\n<|image_pad|>"):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": vllm_text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert ids.count(pad) == 2
        counts.append(len(ids) - 2 + 2 * 6)
    body = {"messages": [{"role": "user", "content": [text("Look at"), IMAGE, text("this"), IMAGE]}]}
    assert oracle(env, "sv", body) == max(counts)


#: model -> (kvgate's count, the engine's) of ``"Look at", image, "this", image, "and that."``
INTERLEAVED = {"sv": (35, 35), "svf": (1553, 1553), "ss": (29, 29), "pv": (35, 31), "ps": (33, 31)}


@pytest.mark.parametrize("model", sorted(INTERLEAVED))
def test_text_and_images(env, model):
    """vLLM's string ``<ph>\\n<ph>\\nLook at\\nthis\\nand that.`` (or in place, the same count
    here): exact, with the two ``\\n`` beside the placeholders that kvgate once left out (33
    counted where vLLM holds 35; ``svf`` 1,551 for 1,553). SGLang's string ``Look at this and
    that.``, the images charged though SGLang drops them. The looping template renders
    ``Look at<ph>this<ph>and that.`` behind either engine; kvgate counts each ``<|image_pad|>`` it
    writes on top of the image's cost (SGLang: 33 for 31) and, as the engines' format detection
    can be overridden, the string form too, the larger kept (vLLM: 35 for 31)."""
    content = [text("Look at"), IMAGE, text("this"), IMAGE, text("and that.")]
    assert admitted(env, model, [{"role": "user", "content": content}]) == INTERLEAVED[model]


#: model -> (kvgate's count, the engine's) of ``"Hello", "", "", "world", ""``
EMPTY_PARTS = {"sv": (16, 16), "ss": (17, 17), "pv": (16, 15), "ps": (17, 15)}


@pytest.mark.parametrize("model", sorted(EMPTY_PARTS))
def test_empty_text_parts(env, model):
    """vLLM's string drops the empty parts: ``Hello\\nworld``, exact (kvgate once counted
    ``Hello\\n\\n\\nworld\\n``, 19). SGLang's string keeps them (``Hello   world ``). The looping
    template gets them all and prints nothing for them (``Helloworld``, 15); kvgate keeps the
    larger string form there."""
    content = [text("Hello"), text(""), text(""), text("world"), text("")]
    assert admitted(env, model, [{"role": "user", "content": content}]) == EMPTY_PARTS[model]


#: model -> (kvgate's count, the engine's) of ``image, "", image``
IMAGES_ONLY = {"sv": (24, 24), "ss": (23, 23), "pv": (25, 23), "ps": (25, 23)}


@pytest.mark.parametrize("model", sorted(IMAGES_ONLY))
def test_images_and_an_empty_part(env, model):
    """``image, "", image``: vLLM's string is the two placeholders joined by ``\\n`` (the empty
    part dropped, no text left; kvgate once counted 23); SGLang's an empty string, the images
    charged; the looping template ``<ph><ph>``, each ``<|image_pad|>`` one token over."""
    content = [IMAGE, text(""), IMAGE]
    assert admitted(env, model, [{"role": "user", "content": content}]) == IMAGES_ONLY[model]


def test_images_over_several_messages(env):
    """Placeholders go in front of each message's own text, one ``\\n`` each: three images over
    a system and two user turns (a 56 x 84 image: 2 x 3 + 2 = 8 tokens); the last turn's lone
    placeholder has none. kvgate once counted 57 (the first user turn's two ``\\n`` left out)."""
    messages = [
        {"role": "system", "content": [text("a b c")]},
        {"role": "user", "content": [IMAGE, text("Hello"), image(84, 56)]},
        {"role": "assistant", "content": "world"},
        {"role": "user", "content": [text(""), IMAGE]},
    ]
    assert admitted(env, "sv", messages) == (59, 59)


def _at_limit_messages() -> list[dict]:
    big = image(1092, 1092)  # qwen2_vl: 39 x 39 + 2 = 1,523 tokens
    return [{"role": "user", "content": [text("Look at"), big, text("this"), big, text("and that.")]}]


#: prompt tokens of :func:`_at_limit_messages` behind vLLM (kvgate once counted 3,067)
AT_LIMIT = 3069


def test_the_limit_counts_the_newlines(env):
    """With ``max_tokens`` filling the live limit exactly the request is admitted (3,276
    reserved); one completion token more is the 400 naming the joined count. kvgate once
    counted 3,067 and admitted that one (3,067 + 208), which vLLM's 3,069 + 208 overruns."""
    client, sg, vl, quotas, _ = env
    messages = _at_limit_messages()
    assert admitted(env, "sv", messages, LIMIT - AT_LIMIT) == (AT_LIMIT, AT_LIMIT)
    assert quotas.reserved[-1] == LIMIT
    before = (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved))
    over = LIMIT - AT_LIMIT + 1
    r = client.post("/v1/chat/completions", json={"model": "sv", "messages": messages, "max_tokens": over})
    assert r.status_code == 400, r.text
    assert r.json() == {
        "error": {
            "message": f"This model's maximum context length is {LIMIT} tokens. However, you requested "
            f"{LIMIT + 1} tokens ({AT_LIMIT} in the messages, {over} in the completion). "
            "Please reduce the length of the messages or completion.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    assert (len(sg.state.requests), len(vl.state.requests), len(quotas.reserved)) == before
