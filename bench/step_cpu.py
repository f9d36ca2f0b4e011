"""CPU time per decode step, kvgate's model against transformers' forward, in one process.

``python bench/backend.py --real-model FOLDER --step-cpu ROUNDS [--batch 8] [--threads N]``: a
512-token context per sequence, then ROUNDS rounds in which each of kvgate b1, kvgate b{batch},
transformers b1 and transformers b{batch} runs one decode step (kvgate: the paged attention and
``compute_logits`` on the last rows, as the engine's runner; transformers: its forward with its
``DynamicCache`` and ``logits_to_keep=1``, cropped back after each step). Prints the medians of
``time.process_time`` per step (ms), steadier than wall time on a loaded host, and the ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from gpu_backend.attention import PagedAttention, SeqSpan
from gpu_backend.kv_pool import KVPool
from gpu_backend.weights import load_hf_llama

CONTEXT = 512
PAGE = 16


def _kvgate_steps(folder: str, prompt: torch.Tensor, sizes: tuple[int, ...]) -> dict[str, Callable[[], object]]:
    """One decode-step callable per batch size, over a pool holding each row's ``prompt`` K/V."""
    with torch.inference_mode(False):  # loaded as the engine loads it, so its matmuls pack (gpu_backend/packed_linear.py)
        model = load_hf_llama(folder).eval()
        model.prepack()
    rows = prompt.shape[0]
    per = (CONTEXT + PAGE) // PAGE + 1
    pool = KVPool(rows * per, PAGE, *model.kv_geometry, torch.float32, "cpu")
    pages = [list(range(i * per, (i + 1) * per)) for i in range(rows)]
    for i in range(rows):
        model(prompt[i], PagedAttention(pool, [SeqSpan(pages[i], 0, CONTEXT, CONTEXT)]))

    def step(b: int) -> object:
        attn = PagedAttention(pool, [SeqSpan(pages[i], CONTEXT, 1, CONTEXT) for i in range(b)])
        return model.compute_logits(model(prompt[:b, -1].clone(), attn)).argmax(-1)

    return {f"kvgate b{b}": (lambda b=b: step(b)) for b in sizes}


def _hf_steps(folder: str, prompt: torch.Tensor, sizes: tuple[int, ...]) -> dict[str, Callable[[], object]]:
    """The same steps through transformers (its cache cropped back to the context after each)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    caches = {b: hf(prompt[:b], use_cache=True, logits_to_keep=1).past_key_values for b in sizes}

    def step(b: int) -> object:
        out = hf(prompt[:b, -1:], past_key_values=caches[b], use_cache=True, logits_to_keep=1)
        caches[b].crop(-1)
        return out.logits[:, -1].argmax(-1)

    return {f"transformers b{b}": (lambda b=b: step(b)) for b in sizes}


def step_cpu_main(folder: str, batch: int, rounds: int) -> int:
    """Print the per-step CPU-time medians (ms) and ratios; returns 0."""
    sizes = (1, batch)
    prompt = torch.randint(0, 40_000, (batch, CONTEXT), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        steps = {**_kvgate_steps(folder, prompt, sizes), **_hf_steps(folder, prompt, sizes)}
        times: dict[str, list[float]] = {k: [] for k in steps}
        for f in steps.values():  # warm-up
            f()
        for _ in range(rounds):
            for k, f in steps.items():
                t = time.process_time()
                f()
                times[k].append(time.process_time() - t)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print(f"CPU ms per decode step, {CONTEXT}-token context, {torch.get_num_threads()} threads, {rounds} rounds:")
    for k, v in med.items():
        print(f"  {k}: {v:.1f}")
    for b in sizes:
        print(f"kvgate/transformers b{b}: {med[f'kvgate b{b}'] / med[f'transformers b{b}']:.3f}")
    agg = batch * med["transformers b1"] / med[f"kvgate b{batch}"]
    print(f"kvgate b{batch} aggregate vs transformers b1: {agg:.2f}x")
    return 0
