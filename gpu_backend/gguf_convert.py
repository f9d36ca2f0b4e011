"""A llama.cpp GGUF file (Llama architecture, byte-level BPE vocabulary) -> a Hugging Face folder
the engine serves: ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32),
``tokenizer.json`` and ``tokenizer_config.json`` (chat template, special tokens, EOS).

What the conversion undoes or rebuilds, and where the rule comes from:

- **Weights**: every tensor is dequantized with ``gguf.quants.dequantize`` (Q4_0/Q4_1/Q8_0/F16/...
  -> fp32). GGUF stores a ``[out, in]`` matrix with ``ne = [in, out]``; the numpy array it reads is
  already ``[out, in]``, the layout of ``torch.nn.Linear.weight``.
- **Q/K row permutation**: llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders
  the rows of ``q_proj`` / ``k_proj`` from HF's rotate-half RoPE layout to interleaved pairs;
  :func:`unpermute_qk` is its inverse (the same as transformers' ``reverse_permute_weights`` in
  ``integrations/ggml.py``), with ``n_head`` for Q and ``n_head_kv`` for K.
- **Tied embeddings**: a file without ``output.weight`` ties the LM head to ``token_embd.weight``
  (llama.cpp does the same at load), so ``tie_word_embeddings`` is true and only the embedding is stored.
- **Tokenizer** (``tokenizer.ggml.model == "gpt2"``): the GGUF vocabulary is already in GPT-2's
  byte-to-unicode form and its merges are ``"a b"`` pairs, so they become a ``tokenizers`` BPE model
  with a ByteLevel pre-tokenizer and decoder. ``tokenizer.ggml.pre`` picks the pre-tokenizer as
  llama.cpp's ``llama-vocab.cpp`` does: ``smollm`` (also ``starcoder``, ``refact``) splits every digit
  on its own (regex ``\\p{N}``) before the GPT-2 regex, i.e. ``Digits(individual_digits=True)`` then
  ``ByteLevel``; ``gpt2`` / ``default`` use ``ByteLevel`` alone. Control tokens (token type 3) and
  user-defined tokens (4) become added tokens (control: ``special=True``). No BOS/EOS is added
  around a prompt unless ``tokenizer.ggml.add_bos_token`` is true.
- **Chat template / EOS**: ``tokenizer.chat_template`` and the ``bos``/``eos``/``unknown``/
  ``padding`` token ids go into ``tokenizer_config.json`` (as token strings) and ``config.json`` /
  ``generation_config.json`` (as ids).

Only the Llama architecture is converted (``general.architecture == "llama"``); anything else
raises ``ValueError``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: GGUF token types (llama.cpp ``llama_token_type``).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

#: ``tokenizer.ggml.pre`` values whose llama.cpp pre-tokenizer splits digits one by one first.
DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"})
#: ``tokenizer.ggml.pre`` values that are GPT-2's regex alone.
GPT2_PRE = frozenset({"gpt2", "default"})

#: GGUF tensor name (``blk.N.`` stripped) -> HF ``LlamaForCausalLM`` name (``{i}``: the layer).
LAYER_TENSORS = {
    "attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

Progress = Callable[[str], None]


@dataclass(frozen=True)
class GGUFLlama:
    """What a Llama GGUF says about its architecture (llama.* keys; HF names in comments)."""

    vocab_size: int
    hidden_size: int  # embedding_length
    intermediate_size: int  # feed_forward_length
    num_layers: int  # block_count
    num_heads: int  # attention.head_count
    num_kv_heads: int  # attention.head_count_kv
    head_dim: int  # rope.dimension_count (else hidden / heads)
    context_length: int
    rms_norm_eps: float
    rope_theta: float


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_architecture(reader: Any) -> GGUFLlama:
    """The architecture of an open ``gguf.GGUFReader``. Raises ``ValueError`` for a non-Llama file
    or a missing key."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama only)")

    def need(key: str) -> Any:
        v = _field(reader, f"llama.{key}")
        if v is None:
            raise ValueError(f"GGUF file has no 'llama.{key}'")
        return v

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    return GGUFLlama(
        vocab_size=int(_field(reader, "llama.vocab_size") or len(tokens)),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv") or heads),
        head_dim=int(_field(reader, "llama.rope.dimension_count") or hidden // heads),
        context_length=int(need("context_length")),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
    )


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` (``convert_hf_to_gguf.py``): ``w`` [n_head x head_dim, in]
    with each head's rows interleaved (pairs) -> HF's rotate-half order (first halves, then second
    halves). ``n_head``: query heads for Q, KV heads for K."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``permute`` (HF -> GGUF row order); :func:`unpermute_qk` undoes it (tests)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(name: str) -> str:
    """The HF ``LlamaForCausalLM`` name of GGUF tensor ``name``. Raises ``ValueError`` for a name
    with no counterpart, and for ``rope_freqs.weight`` (llama3 RoPE scaling, not supported)."""
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in LAYER_TENSORS:
            return LAYER_TENSORS[rest].format(i=int(layer))
    elif name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    elif name == "rope_freqs.weight":  # llama3 scaling factors; not used by a default-RoPE config
        raise ValueError("GGUF files with rope_freqs (llama3 RoPE scaling) are not supported")
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart")


def hf_weight(tensor: Any, arch: GGUFLlama) -> np.ndarray:
    """One GGUF tensor dequantized to a contiguous fp32 array, Q/K rows back in HF's order."""
    from gguf.quants import dequantize

    w = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if tensor.name.endswith("attn_q.weight"):
        w = unpermute_qk(w, arch.num_heads)
    elif tensor.name.endswith("attn_k.weight"):
        w = unpermute_qk(w, arch.num_kv_heads)
    return np.ascontiguousarray(w)


def check_shapes(state: dict[str, np.ndarray], arch: GGUFLlama) -> None:
    """Raise ``ValueError`` when ``state`` lacks a tensor of ``arch`` or holds one of the wrong
    shape (the LM head is expected only when the file has one, i.e. untied)."""
    expected = expected_shapes(arch, tied="lm_head.weight" not in state)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"GGUF file lacks tensors {missing[:4]}")
    for k, shape in expected.items():
        if tuple(state[k].shape) != shape:
            raise ValueError(f"{k}: shape {tuple(state[k].shape)}, expected {shape}")


def hf_state_dict(reader: Any, arch: GGUFLlama, progress: Progress | None = None) -> dict[str, np.ndarray]:
    """Every tensor dequantized to fp32, renamed to HF, Q/K un-permuted. Raises ``ValueError`` for
    an unknown tensor name, a missing tensor or a shape that does not match ``arch``."""
    out: dict[str, np.ndarray] = {}
    total = len(reader.tensors)
    for n, t in enumerate(reader.tensors, 1):
        out[hf_name(t.name)] = hf_weight(t, arch)
        if progress and (n % 30 == 0 or n == total):
            progress(f"dequantized {n}/{total} tensors")
    check_shapes(out, arch)
    return out


def expected_shapes(arch: GGUFLlama, tied: bool) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for ``arch`` (``lm_head.weight`` only when not tied)."""
    h, kv = arch.hidden_size, arch.num_kv_heads * arch.head_dim
    q = arch.num_heads * arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not tied:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (arch.intermediate_size, h),
            p + "mlp.up_proj.weight": (arch.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, arch.intermediate_size),
        }
    return shapes


def build_tokenizer(reader: Any) -> tuple[Any, dict[str, Any]]:
    """``(tokenizers.Tokenizer, special token strings)`` from the GGUF vocabulary (see module doc).
    The dict has ``bos_token``/``eos_token``/``unk_token``/``pad_token`` (those the file names) and
    ``add_bos_token``. Raises ``ValueError`` for a tokenizer model other than ``gpt2`` or an
    unsupported ``tokenizer.ggml.pre``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' only)")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in DIGIT_SPLIT_PRE | GPT2_PRE:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported ({sorted(DIGIT_SPLIT_PRE | GPT2_PRE)})")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    types: list[int] = list(_field(reader, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=(ty == TOKEN_CONTROL), normalized=False, lstrip=False, rstrip=False)
        for i, ty in enumerate(types)
        if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]
    # add_tokens keeps the ids the vocabulary already gives these strings
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    if add_bos and bos_id is not None:
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials: dict[str, Any] = {"add_bos_token": add_bos}
    for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"), ("padding", "pad_token")):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= int(i) < len(tokens):
            specials[name] = tokens[int(i)]
            specials[name + "_id"] = int(i)
    for i, t in enumerate(tokens):  # ids must survive the round trip (added tokens keep their vocab ids)
        if tok.token_to_id(t) != i:
            raise ValueError(f"token {t!r} maps to {tok.token_to_id(t)}, not {i}")
    return tok, specials


def hf_config(arch: GGUFLlama, tied: bool, specials: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` with ``arch`` (fp32)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "max_position_embeddings": arch.context_length,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": specials.get("bos_token_id"),
        "eos_token_id": specials.get("eos_token_id"),
        "pad_token_id": specials.get("pad_token_id"),
        "torch_dtype": "float32",
    }


def tokenizer_config(reader: Any, arch: GGUFLlama, specials: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json``: chat template, special tokens, no BOS/EOS added unless the GGUF says so."""
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": specials["add_bos_token"],
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": arch.context_length,
    }
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if name in specials:
            cfg[name] = specials[name]
    template = _field(reader, "tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return cfg


def convert(gguf_path: str | Path, out_dir: str | Path, progress: Progress | None = None) -> dict[str, Any]:
    """Convert ``gguf_path`` into the HF folder ``out_dir`` (created; files overwritten). Returns
    ``config.json``'s dict. Raises ``ValueError`` (unsupported file, bad tensors) and ``OSError``."""
    import gguf
    from safetensors.numpy import save_file

    say = progress or (lambda _m: None)
    reader = gguf.GGUFReader(str(gguf_path))
    arch = read_architecture(reader)
    say(
        f"GGUF: llama, {arch.num_layers} layers, hidden {arch.hidden_size}, {arch.num_heads} query / "
        f"{arch.num_kv_heads} KV heads, vocab {arch.vocab_size}, context {arch.context_length}"
    )
    tok, specials = build_tokenizer(reader)
    state = hf_state_dict(reader, arch, say)
    tied = "lm_head.weight" not in state
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    n_params = sum(int(v.size) for v in state.values())
    del state
    say(f"wrote model.safetensors ({n_params:,} parameters, fp32, tied embeddings: {tied})")
    tok.save(str(out / "tokenizer.json"))
    cfg = hf_config(arch, tied, specials)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(reader, arch, specials), indent=2) + "\n")
    say("wrote config.json, generation_config.json, tokenizer.json, tokenizer_config.json")
    return cfg
