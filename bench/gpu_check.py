"""GPU check of the engine core in SmolLM2-135M's shape, with seeded random weights (no download,
no network, no fastapi: only torch and transformers are needed on the GPU machine).

    python bench/gpu_check.py [--device cuda] [--dtype bfloat16] [--batches 1,8,32]
                              [--prompt-tokens 512] [--decode-steps 64] [--hbm-gbps N] [--json FILE]

1. **Parity** (fp32, TF32 off): the engine's ``LlamaModel`` through paged attention (prefill of a
   prompt, then decode steps one token at a time through the page table) against ``transformers``'
   ``LlamaForCausalLM`` holding the same weights; max |logit difference| must be <= ``--tol``
   (default 2e-3). Exit status 1 when it is not.
2. **Decode speed** at each batch size (``--dtype``, default bf16): greedy decode steps of ``B``
   sequences that each hold ``--prompt-tokens`` tokens of context; tokens/s and the step time.
3. **HBM floor**: a decode step must read every weight once and every cached K/V byte of the
   batch, so ``floor = (weight bytes + KV bytes of the batch) / bandwidth``; the bandwidth is
   measured here with a device-to-device copy (or given as ``--hbm-gbps``). ``step / floor`` says
   how far the step is from memory-bound (1.0x is the ideal; small batches on a 135M model are
   launch-bound, so expect large ratios at batch 1).

Not a test and not run by CI; prints one table (and writes ``--json``, or ``$OUT/gpu_check.json``
when ``OUT`` is set).
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import argparse
import json
import time

import torch

from gpu_backend.attention import PagedAttention, SeqSpan
from gpu_backend.model import LlamaModel, ModelConfig

#: SmolLM2-135M-Instruct's config.json (as the converter writes it from the GGUF).
SMOLLM2_135M = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}


class _Pool:
    """The slice of :class:`gpu_backend.kv_pool.KVPool` paged attention uses (``page_size``,
    ``device``, ``layer_cache``), so this script needs neither the config package nor pydantic."""

    def __init__(self, num_pages: int, page_size: int, layers: int, kv_heads: int, head_dim: int, dtype, device):
        self.page_size, self.device = page_size, torch.device(device)
        self.kv = torch.zeros(layers, 2, num_pages * page_size, kv_heads, head_dim, dtype=dtype, device=device)

    def layer_cache(self, layer: int):
        return self.kv[layer, 0], self.kv[layer, 1]


def seeded_model(seed: int = 0) -> LlamaModel:
    """SmolLM2-135M's architecture with normal(0, 0.02) weights and norms near 1 (CPU, fp32)."""
    model = LlamaModel(ModelConfig.from_hf(SMOLLM2_135M))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def hf_twin(model: LlamaModel):
    """``transformers.LlamaForCausalLM`` with the same weights (the engine uses HF tensor names)."""
    import transformers

    cfg = transformers.LlamaConfig(**{k: v for k, v in SMOLLM2_135M.items() if k != "model_type"})
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    hf.tie_weights()
    return hf


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parity(model: LlamaModel, hf, device: torch.device, prompt_tokens: int, steps: int, page_size: int) -> float:
    """Max |logit difference| over the prompt's last position and ``steps`` paged decode steps."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(17, SMOLLM2_135M["vocab_size"], (prompt_tokens + steps,), generator=g).tolist()
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids], device=device)).logits[0].float()
        n_pages = -(-(prompt_tokens + steps) // page_size)
        layers, kv_heads, head_dim = model.kv_geometry
        pool = _Pool(n_pages + 3, page_size, layers, kv_heads, head_dim, torch.float32, device)
        pages = list(range(3, 3 + n_pages))[::-1]  # not 0..n: the page table must matter
        attn = PagedAttention(pool, [SeqSpan(pages, 0, prompt_tokens)])
        h = model(torch.tensor(ids[:prompt_tokens], device=device), attn)
        worst = (model.compute_logits(h[-1:])[0] - ref[prompt_tokens - 1]).abs().max().item()
        for j in range(steps):
            pos = prompt_tokens + j
            attn = PagedAttention(pool, [SeqSpan(pages, pos, 1)])
            h = model(torch.tensor([ids[pos]], device=device), attn)
            worst = max(worst, (model.compute_logits(h)[0] - ref[pos]).abs().max().item())
    return worst


def measured_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device copy bandwidth (read + write bytes / time), GB/s."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    _sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0) / 1e9


def decode_speed(model: LlamaModel, device: torch.device, batch: int, ctx: int, steps: int, page_size: int) -> dict:
    """Greedy decode of ``batch`` sequences with ``ctx`` tokens of context each: tokens/s, step ms,
    and the bytes one step must read (weights + the batch's KV)."""
    layers, kv_heads, head_dim = model.kv_geometry
    per_seq = -(-(ctx + steps + 8) // page_size)
    dtype = next(model.parameters()).dtype
    pool = _Pool(batch * per_seq, page_size, layers, kv_heads, head_dim, dtype, device)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        ids = torch.randint(17, SMOLLM2_135M["vocab_size"], (batch * ctx,), generator=g).to(device)
        attn = PagedAttention(pool, [SeqSpan(t, 0, ctx) for t in tables])
        h = model(ids, attn)
        nxt = model.compute_logits(h[torch.arange(1, batch + 1, device=device) * ctx - 1]).argmax(-1)
        for warm in range(3):
            attn = PagedAttention(pool, [SeqSpan(t, ctx + warm, 1) for t in tables])
            nxt = model.compute_logits(model(nxt, attn)).argmax(-1)
        _sync(device)
        t0 = time.perf_counter()
        for j in range(steps):
            attn = PagedAttention(pool, [SeqSpan(t, ctx + 3 + j, 1) for t in tables])
            nxt = model.compute_logits(model(nxt, attn)).argmax(-1)
        _sync(device)
        dt = time.perf_counter() - t0
    el = torch.empty((), dtype=dtype).element_size()
    weight_bytes = sum(p.numel() for p in model.parameters()) * el  # tied: counted once by parameters()
    kv_bytes = batch * (ctx + 3 + steps // 2) * layers * 2 * kv_heads * head_dim * el
    return {
        "batch": batch,
        "tok/s": batch * steps / dt,
        "step ms": dt / steps * 1e3,
        "bytes/step": weight_bytes + kv_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tol", type=float, default=2e-3)
    ap.add_argument("--hbm-gbps", type=float, default=None, help="HBM bandwidth (default: measured by a copy)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_check: {name}, torch {torch.__version__}", flush=True)

    base = seeded_model()
    hf = hf_twin(base).to(device)
    model = base.to(device)
    worst = parity(model, hf, device, prompt_tokens=64, steps=8, page_size=a.page_size)
    ok = worst <= a.tol
    print(f"parity (fp32, paged vs transformers): max |dlogit| = {worst:.2e} (tol {a.tol:g}) {'ok' if ok else 'FAIL'}")
    del hf

    model = model.to(dtype=getattr(torch, a.dtype))
    bw = a.hbm_gbps or (measured_bandwidth_gbps(device) if device.type == "cuda" else None)
    rows = []
    for b in [int(x) for x in a.batches.split(",") if x]:
        r = decode_speed(model, device, b, a.prompt_tokens, a.decode_steps, a.page_size)
        if bw:
            r["floor ms"] = r["bytes/step"] / (bw * 1e9) * 1e3
            r["step/floor"] = r["step ms"] / r["floor ms"]
        rows.append(r)
    bw_text = f"{bw:.0f} GB/s ({'given' if a.hbm_gbps else 'measured copy'})" if bw else "n/a"
    print(f"\ndecode, {a.dtype}, context {a.prompt_tokens} tokens per sequence, bandwidth {bw_text}")
    print(f"{'batch':>6} {'tok/s':>10} {'step ms':>9} {'MB/step':>9} {'floor ms':>9} {'step/floor':>10}")
    for r in rows:
        floor = f"{r['floor ms']:9.3f} {r['step/floor']:9.1f}x" if "floor ms" in r else f"{'-':>9} {'-':>10}"
        print(f"{r['batch']:>6} {r['tok/s']:10.1f} {r['step ms']:9.3f} {r['bytes/step'] / 1e6:9.1f} {floor}")
    out = a.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump({"device": name, "parity_max_abs": worst, "parity_ok": ok, "bandwidth_gbps": bw, "rows": rows}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
