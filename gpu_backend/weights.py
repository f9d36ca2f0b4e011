"""Building the model: seeded tiny-random, copy-probe, or a local Hugging Face Llama checkpoint.

A checkpoint folder holds ``config.json`` and ``*.safetensors`` (one file or shards; names as
transformers saves ``LlamaForCausalLM``). Loaded with ``safetensors`` (never pickle).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import torch
from safetensors import safe_open

from gpu_backend.copy_probe import CopyProbeModel
from gpu_backend.model import LlamaModel, ModelConfig

#: Vocabulary of the bundled tokenizer (cl100k_base + ChatML specials): ids 0 .. 100,276.
BUNDLED_VOCAB = 100_277

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tiny_random_config(context_length: int) -> ModelConfig:
    """tiny-random: 2 layers, hidden 64, GQA 4 query / 2 KV heads of 16, SwiGLU 128, bundled vocab."""
    return ModelConfig(
        vocab_size=BUNDLED_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=context_length,
        tie_word_embeddings=False,
    )


def tiny_random(context_length: int, seed: int) -> LlamaModel:
    """The seeded tiny-random Llama (normal(0, 0.02) weights, unit norms; same seed -> same weights)."""
    model = LlamaModel(tiny_random_config(context_length))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def load_hf_llama(path: str | Path) -> LlamaModel:
    """A ``LlamaForCausalLM`` checkpoint folder -> :class:`LlamaModel` (fp32 on CPU; the caller moves
    it). Raises ``FileNotFoundError`` (no folder / config.json / safetensors), ``ValueError``
    (unsupported architecture, missing or unexpected tensors, shape mismatch)."""
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    cfg = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    model = LlamaModel(cfg)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                state[k] = st.get_tensor(k)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(k for k in set(state) - set(own) if not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise ValueError(f"checkpoint {folder}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    for k, t in own.items():
        if tuple(state[k].shape) != tuple(t.shape):
            raise ValueError(f"checkpoint {folder}: {k} has shape {tuple(state[k].shape)}, expected {tuple(t.shape)}")
    model.load_state_dict({k: state[k].float() for k in own}, strict=True)
    return model


def build_model(name: str, context_length: int, seed: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """``tiny-random`` | ``copy-probe`` | a checkpoint folder -> model in eval mode on ``device``.
    Raises ``ValueError`` for an unknown name that is not a folder either."""
    if name in ("tiny-random", "copy-probe"):
        model = _builtin(name, context_length, seed)
        if device.type != "cpu" or dtype != torch.float32:
            model = copy.deepcopy(model)  # .to() works in place: never move the shared CPU copy
    elif Path(name).is_dir():
        model = load_hf_llama(name)
    else:
        raise ValueError(f"unknown model '{name}': use tiny-random, copy-probe or a local checkpoint folder")
    return model.to(device=device, dtype=dtype).eval()


@functools.lru_cache(maxsize=4)
def _builtin(name: str, context_length: int, seed: int) -> torch.nn.Module:
    """Built-in models are deterministic and read-only at inference: build each (CPU, fp32) once per
    process; ``.to()`` copies them when another device or dtype is asked for."""
    if name == "tiny-random":
        return tiny_random(context_length, seed).eval()
    return CopyProbeModel(BUNDLED_VOCAB, context_length, seed).eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied weights counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def shared_or_built(
    model: torch.nn.Module | None, name: str, context_length: int, seed: int, dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    """``model`` when given (an already-built model shared with another engine in the process),
    else :func:`build_model`. ``ValueError`` when a shared model is in training mode or has a
    parameter off ``device`` / ``dtype``."""
    if model is None:
        return build_model(name, context_length, seed, dtype, device)
    if model.training or any(t.device != device or t.dtype != dtype for t in model.parameters()):
        raise ValueError(f"a shared model must be in eval mode on {device} as {str(dtype).removeprefix('torch.')}")
    return model
