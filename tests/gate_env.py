"""The gate's test setup (tests/test_gate_invariant.py, tests/test_gate_property.py): a gateway
in front of two recording mock engines (one SGLang-shaped, one vLLM-shaped), with one model per
engine mix and image policy, and a quota stage that records each admitted request's reservation.

Pool 4096 tokens, headroom 1.25 -> live limit 3,276 tokens; tenant ``max_tokens_cap`` 256,
``default_max_tokens`` 16, ``max_sequences_per_request`` 16 (the default).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from config.models import Settings
from gateway.quotas.stage import QuotaLease
from tests.gateway_harness import KEY_A, Gateway, tenants
from tests.mock_engine import MockEngine

LIMIT = 3276
CAP = 256
MAX_SEQUENCES = 16
#: model -> the engines that serve it
ENGINES = {
    "m": {"sglang"},
    "mv": {"vllm"},
    "mo": {"openai"},
    "mix": {"sglang", "vllm"},
    "mimg": {"sglang"},
    "mq": {"sglang"},
    "mh": {"vllm"},
}
#: ``mh``'s chat template: ChatML whose generation prompt reads ``enable_thinking`` (as Qwen3's does)
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
__all__ = [
    "CAP",
    "ENGINES",
    "KEY_A",
    "LIMIT",
    "MAX_SEQUENCES",
    "THINK_TEMPLATE",
    "Quotas",
    "gate_env",
    "gate_settings",
    "make_hf_folder",
]


def make_bpe_folder(folder: Path, template: str, corpus: str, vocab_size: int) -> Path:
    """A tiny Hugging Face tokenizer folder in ``folder``: byte-level BPE trained here on
    ``corpus`` (50 times; no download) up to ``vocab_size``, with chat template ``template``."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([corpus] * 50, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def make_hf_folder(folder: Path) -> Path:
    """:func:`make_bpe_folder` with :data:`THINK_TEMPLATE`, for the ``mh`` model."""
    return make_bpe_folder(
        folder, THINK_TEMPLATE, "Hello world, a b c user assistant system <think> </think> 日本語 é", 500
    )


class Quotas:
    """A QuotaStage that records what each admitted request reserved."""

    def __init__(self) -> None:
        self.reserved: list[int] = []

    async def begin(self, tenant, request_id):
        return QuotaLease(tenant.id, request_id, 0, headers={})

    def combines(self, tenant):
        return False  # the two steps: begin, then reserve_tokens

    async def reserve_tokens(self, tenant, lease, tokens, *, also=None):
        self.reserved.append(tokens)
        lease.reserved_tokens = tokens

    async def settle(self, lease, used_tokens):
        return None

    async def aclose(self):
        return None


def gate_settings(sg: MockEngine, vl: MockEngine, hf_folder: Path) -> Settings:
    """Models: ``m`` (SGLang), ``mv`` (vLLM), ``mo`` (an OpenAI-style static upstream), ``mix``
    (SGLang and vLLM), ``mimg`` (OpenAI tile cost, one allowed image host), ``mq`` (Qwen2-VL
    cost); all counted with the bundled ChatML tokenizer."""
    return Settings.model_validate(
        {
            "gateway": {"max_body_bytes": 8 * 1024 * 1024, "connect_timeout_seconds": 1, "read_timeout_seconds": 5},
            "pool": {"poll_interval_seconds": 0.2, "max_staleness_seconds": 5, "request_timeout_seconds": 2.0},
            "models": [
                {"id": "m", "context_length": 8192},
                {"id": "mv", "context_length": 8192},
                {"id": "mo", "context_length": 8192},
                {"id": "mix", "context_length": 8192},
                {
                    "id": "mimg",
                    "context_length": 8192,
                    "images": {"cost": "openai_tiles", "allowed_url_hosts": ["images.example"]},
                },
                {"id": "mq", "context_length": 8192, "images": {"cost": "qwen2_vl"}},
                {"id": "mh", "context_length": 8192, "tokenizer": {"kind": "hf", "path": str(hf_folder)}},
            ],
            "upstreams": [
                {
                    "name": "sg",
                    "api_url": sg.api_url,
                    "pool_source": "sglang",
                    "pool_urls": [sg.info_url],
                    "models": ["m", "mix", "mimg", "mq"],
                },
                {
                    "name": "vl",
                    "api_url": vl.api_url,
                    "pool_source": "vllm",
                    "pool_urls": [vl.url + "/v1/models"],
                    "models": ["mv", "mix", "mh"],
                },
                {
                    "name": "oa",
                    "api_url": sg.api_url,
                    "pool_source": "static",
                    "static_pool_tokens": 4096,
                    "models": ["mo"],
                },
            ],
            "verifier": {"enabled": False},
            "quotas": {"enabled": False},
        }
    )


@contextlib.contextmanager
def mock_pair_env(
    make_folder: Callable[[Path], Path],
    make_settings: Callable[[MockEngine, MockEngine, Path], Settings],
    engine: Callable[[], MockEngine] = MockEngine,
    **tenant: Any,
) -> Iterator[tuple]:
    """``(client, sglang mock, vllm mock, quotas, tokenizer folder)`` with the gateway ready: the
    folder made by ``make_folder`` in a temporary directory, the gateway on ``make_settings``,
    the two mocks made by ``engine``; ``tenant``: limits of :data:`KEY_A`'s tenant over the
    defaults (cap :data:`CAP`, 16 tokens by default, every model)."""
    tmp = tempfile.TemporaryDirectory()
    folder = make_folder(Path(tmp.name))
    sg, vl = engine().start(), engine().start()
    vl.state.vllm_max_model_len = 4096
    q = Quotas()
    reg = tenants(**{"max_tokens_cap": CAP, "default_max_tokens": 16, "allowed_models": [], **tenant})
    g = Gateway(make_settings(sg, vl, folder), reg, quotas=q).start()
    try:
        with g.client(KEY_A, timeout=30) as c:
            deadline = time.monotonic() + 10
            while c.get("/readyz").status_code != 200:
                if time.monotonic() > deadline:
                    raise AssertionError("gateway not ready")
                time.sleep(0.05)
            yield c, sg, vl, q, folder
    finally:
        g.stop()
        sg.stop()
        vl.stop()
        tmp.cleanup()


def gate_env(**tenant: Any) -> contextlib.AbstractContextManager[tuple]:
    """``(client, sglang mock, vllm mock, quotas, HF folder of mh)`` with the gateway ready;
    ``tenant``: :func:`mock_pair_env`'s."""
    return mock_pair_env(make_hf_folder, gate_settings, **tenant)
