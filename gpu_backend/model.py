"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) whose attention reads
K/V through the paged cache (:mod:`gpu_backend.attention`).

Numerics follow Hugging Face ``transformers``' ``LlamaForCausalLM`` (RMSNorm in fp32, rotate-half
RoPE, optional ``llama3`` RoPE scaling, ``attention_bias`` / ``mlp_bias``), so a checkpoint gives the
same logits (tests: max abs difference <= 1e-4 in fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu_backend.packed_linear import LAYER_ROWS, LOGITS_ROWS, PackedMatmul, tensor_version


@dataclass
class ModelConfig:
    """Architecture of a Llama-family model (HF ``config.json`` names in comments)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor", ...} or None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a HF ``config.json`` dict (transformers 4.x ``rope_theta``/``rope_scaling`` or 5.x
        ``rope_parameters``). Raises ``ValueError`` for a non-Llama model or an unsupported RoPE type."""
        mt = hf.get("model_type", "llama")
        if mt != "llama":
            raise ValueError(f"model_type '{mt}' is not supported (Llama-family 'llama' only)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act '{hf.get('hidden_act')}' is not supported (silu only)")
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or None
        if scaling:
            rope.update(scaling)
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in ("default", "llama3"):
            raise ValueError(f"rope_type '{rtype}' is not supported (default, llama3)")
        heads = int(hf["num_attention_heads"])
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope if rtype == "llama3" else None,
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32), with ``llama3`` scaling as transformers does."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if not s:
        return inv
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    low_wl, high_wl = old / lo, old / hi
    wl = 2 * math.pi / inv
    out = torch.where(wl > low_wl, inv / factor, inv)
    smooth = (old / wl - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wl < high_wl) & ~(wl > low_wl)
    return torch.where(medium, smoothed, out)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' form) as ``x * cos + roll(x) * sin_signed``
    with ``sin_signed = [-sin, sin]``: the same products (negation is exact), one op fewer."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin_signed


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (as transformers' LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


class FusedLinear:
    """One or several ``nn.Linear`` of one input computed as one matmul: ``self(x) -> [..., sum of
    outs]`` (their outputs side by side, in the given order), through
    :class:`~gpu_backend.packed_linear.PackedMatmul` (MKL's packed GEMM for a few rows on the CPU).

    The fused weight (and bias) of several is built on first use; the modules' parameters then
    become views of it, so their names, state dict and in-place loading (``load_state_dict``) are
    unchanged and no weight is held twice (one linear's weight is used as it is). When a
    parameter's storage changes (``.to()``, ``deepcopy``, a new ``.data``) the next call fuses
    again; when one is written in place (its version moves; the fused weight's own does not, as a
    parameter's ``.data`` keeps its own counter) the packed copy is made again. A parameter
    without a version counter (made under ``inference_mode``) is never packed.
    """

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self._fused: tuple[tuple[int, ...], torch.Tensor, torch.Tensor | None] = ((), torch.empty(0), None)
        self._versions: tuple[int, ...] | None = None  # None: a parameter has no version counter
        self._matmul = PackedMatmul(LAYER_ROWS)

    def _params(self) -> list[torch.Tensor]:
        if len(self.linears) == 1:
            m = self.linears[0]
            return [m.weight] if m.bias is None else [m.weight, m.bias]
        return [m.weight for m in self.linears] + [m.bias for m in self.linears if m.bias is not None]

    def _fuse(self) -> None:
        if len(self.linears) == 1:
            m = self.linears[0]
            w, b = m.weight, m.bias
        else:
            # a normal tensor even when first called under inference_mode: later in-place loads work
            with torch.inference_mode(False), torch.no_grad():
                w = torch.cat([m.weight for m in self.linears])
                b = torch.cat([m.bias for m in self.linears]) if self.linears[0].bias is not None else None
                row = 0
                for m in self.linears:
                    n = m.weight.shape[0]
                    m.weight.data = w[row : row + n]
                    if b is not None:
                        m.bias.data = b[row : row + n]
                    row += n
        params = self._params()
        self._fused = (tuple(p.data_ptr() for p in params), w, b)
        self._versions = () if all(tensor_version(p) is not None for p in params) else None

    def weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused weight ``[sum of outs, in]`` and bias (``None`` without one), fused now if stale."""
        params = self._params()
        ptrs, w, b = self._fused
        if tuple(p.data_ptr() for p in params) != ptrs:
            self._fuse()
            params = self._params()
            _, w, b = self._fused
        if self._versions is not None:
            versions = tuple(p._version for p in params)
            if versions != self._versions:
                self._matmul.forget()
                self._versions = versions
        return w, b

    def prepack(self, enabled: bool = True) -> int:
        """Fuse and pack now (:meth:`PackedMatmul.pack`); returns the bytes the packed copy holds.
        ``enabled=False``: never pack (the copy dropped; every call ``F.linear``), 0 bytes."""
        self._matmul.enabled = enabled
        if not enabled:
            self._matmul.forget()
        w, _ = self.weights()
        if self._versions is None:
            return 0
        self._matmul.pack(w)
        return self._matmul.packed_bytes(w)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weights()
        if self._versions is None:  # a parameter whose in-place writes cannot be told: never packed
            return F.linear(x, w, b)
        return self._matmul(x, w, b)


class Attention(nn.Module):
    """GQA self-attention; K/V storage and lookup are the ``attn`` object's (paged or contiguous).
    q/k/v are one matmul (:class:`FusedLinear`); the parameters keep their checkpoint names."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=b)
        self.qkv = FusedLinear(self.q_proj, self.k_proj, self.v_proj)
        self.o = FusedLinear(self.o_proj)
        self.split = (self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd)
        self.scale = self.hd**-0.5

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        T = h.shape[0]
        q, k, v = self.qkv(h).split(self.split, dim=-1)
        q = _rope(q.view(T, self.nh, self.hd), cos, sin)
        k = _rope(k.view(T, self.nkv, self.hd), cos, sin)
        o = attn.attend(self.layer, q, k, v.view(T, self.nkv, self.hd), self.scale)
        return self.o(o.reshape(T, self.nh * self.hd))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). gate and up stay two matmuls: one [2 x intermediate]
    matmul measured slower on CPU for 8+ rows (docs/performance.md)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        b = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=b)
        self.gate = FusedLinear(self.gate_proj)
        self.up = FusedLinear(self.up_proj)
        self.down = FusedLinear(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = F.silu(self.gate(x), inplace=True)
        return self.down(g.mul_(self.up(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        """``h`` [T, hidden] is updated in place (the model's own running residual)."""
        h += self.self_attn(self.input_layernorm(h), cos, sin, attn)
        return h.add_(self.mlp(self.post_attention_layernorm(h)))


class LlamaModel(nn.Module):
    """Llama-family causal LM. Parameter names match HF checkpoints (``model.layers.N...``,
    ``lm_head.weight``), so ``load_state_dict`` takes a HF state dict as is.

    ``forward(input_ids [T], attn) -> hidden [T, hidden]`` (positions come from ``attn.positions``);
    ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` fp32.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._logits = PackedMatmul(LOGITS_ROWS)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    # KV geometry the pool needs
    @property
    def kv_geometry(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the KV cache."""
        c = self.config
        return c.num_layers, c.num_kv_heads, c.head_dim

    def forward(self, input_ids: torch.Tensor, attn) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        freqs = attn.positions.float()[:, None] * self.inv_freq.float()[None, :]
        cos = freqs.cos().to(h.dtype).repeat(1, 2)[:, None, :]
        sin = freqs.sin().to(h.dtype)
        sin = torch.cat((-sin, sin), dim=-1)[:, None, :]  # signed for _rope
        for layer in self.model.layers:
            h = layer(h, cos, sin, attn)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits(hidden, self.lm_head.weight).float()

    def prepack(self, enabled: bool = True) -> int:
        """Pack every matmul's weight now (:class:`~gpu_backend.packed_linear.PackedMatmul`), so
        the memory is taken before the KV pool is sized; returns the bytes the packed copies hold
        (0 where nothing packs: another device or dtype, no MKL). ``enabled=False``: no matmul
        packs (copies made earlier are dropped), 0 bytes."""
        held = sum(f.prepack(enabled) for f in self._linears())
        self._logits.enabled = enabled
        if not enabled:
            self._logits.forget()
        self._logits.pack(self.lm_head.weight)
        return held + self._logits.packed_bytes(self.lm_head.weight)

    def _linears(self) -> list[FusedLinear]:
        out: list[FusedLinear] = []
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            out += [a.qkv, a.o, m.gate, m.up, m.down]
        return out
