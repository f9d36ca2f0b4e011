"""HF parity: a tiny random ``transformers`` LlamaForCausalLM saved to a folder, loaded by the
engine's loader; logits match for prefill and for decode steps through the paged cache (fp32,
max abs difference <= 1e-4)."""

from __future__ import annotations

import pytest
import torch
from backend_core_support import collect, make_engine  # noqa: F401  (fixture)

from gpu_backend.attention import PagedAttention, SeqSpan
from gpu_backend.kv_pool import KVPool
from gpu_backend.weights import load_hf_llama

transformers = pytest.importorskip("transformers")

TOL = 1e-4


def _save_tiny_llama(folder, **overrides):
    kw = dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    cfg = transformers.LlamaConfig(**{**kw, **overrides})
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # HF initialises norms to 1; perturb them so the test sees their weights
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("variant", ["plain", "tied+llama3-rope"])
def test_logits_match_transformers_prefill_and_paged_decode(tmp_path, variant):
    over = {}
    if variant != "plain":
        over = dict(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    hf = _save_tiny_llama(tmp_path, **over)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors"))
    model = load_hf_llama(tmp_path).eval()
    pool = KVPool(8, 16, 2, 2, 16, torch.float32, "cpu")
    # two sequences of different lengths prefilled in one batch (padding path), then decoded together
    prompts = [[(7 * i + 3) % 1000 for i in range(21)], [(11 * i + 5) % 1000 for i in range(9)]]
    pages = [pool.try_alloc(4, "a"), pool.try_alloc(4, "b")]
    with torch.inference_mode():
        attn = PagedAttention(pool, [SeqSpan([h.index for h in pages[b]], 0, len(p)) for b, p in enumerate(prompts)])
        hidden = model(torch.tensor(prompts[0] + prompts[1]), attn)
        logits = model.compute_logits(hidden)
    ours = [logits[:21], logits[21:]]
    for b, p in enumerate(prompts):
        diff = (ours[b] - _hf_logits(hf, p)).abs().max().item()
        assert diff <= TOL, f"prefill seq {b}: {diff}"
    seqs = [list(p) for p in prompts]
    for step in range(6):  # greedy decode, one token per sequence per step, through the page tables
        for b in range(2):
            seqs[b].append(int(ours[b][-1].argmax()))
        with torch.inference_mode():
            attn = PagedAttention(pool, [SeqSpan([h.index for h in pages[b]], len(seqs[b]) - 1, 1) for b in range(2)])
            logits = model.compute_logits(model(torch.tensor([seqs[0][-1], seqs[1][-1]]), attn))
        ours = [logits[0:1], logits[1:2]]
        for b in range(2):
            ref = _hf_logits(hf, seqs[b])[-1:]
            diff = (ours[b] - ref).abs().max().item()
            assert diff <= TOL, f"decode step {step} seq {b}: {diff}"


async def test_engine_serves_a_checkpoint_folder_greedy_like_transformers(tmp_path, make_engine):
    hf = _save_tiny_llama(tmp_path)
    eng = await make_engine(model=str(tmp_path), max_total_tokens=512, context_length=512)
    assert eng.vocab_size == 1000
    prompt = [(13 * i + 1) % 1000 for i in range(17)]
    toks, _, last = await collect(eng, "hf", prompt, max_new_tokens=8, ignore_eos=True)
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(_hf_logits(hf, ids)[-1].argmax()))
    assert toks == ids[17:] and last.finish_reason == "length"


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_hf_llama(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not supported"):
        load_hf_llama(tmp_path)
