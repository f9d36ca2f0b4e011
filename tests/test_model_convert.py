"""The GGUF -> HF converter and ``kvgate model pull``'s failure paths, without any download.

A tiny Llama is built with ``transformers``, its Q/K rows permuted as llama.cpp's
``convert_hf_to_gguf.py`` does, and written with ``gguf.GGUFWriter`` next to a byte-level BPE
vocabulary trained here with ``tokenizers`` (digits split one by one, as SmolLM2's). The converter
must give back the same logits (fp32) and the same token ids as the originals.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from gpu_backend import gguf_convert, model_store
from gpu_backend.gguf_convert import permute_qk, unpermute_qk
from tokenizer.hf_counter import HFCounter

ROOT = Path(__file__).resolve().parent.parent
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "In 2024 there were 365 days and 12 months; 3.14159 is pi.",
    "東京は日本の首都です。你好，世界！",
    "def add(a, b):\n    return a + b\n",
] * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _trained_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _write_gguf(path: Path, hf, tok) -> None:
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    names = {v.format(i="{i}"): k for k, v in gguf_convert.LAYER_TENSORS.items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf_tmpl, g in names.items():
            a = sd[hf_tmpl.format(i=i)]
            if g == "attn_q.weight":
                a = permute_qk(a, cfg.num_attention_heads)
            elif g == "attn_k.weight":
                a = permute_qk(a, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{g}", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(original tokenizer, original HF model, converted folder)."""
    base = tmp_path_factory.mktemp("gguf")
    tok = _trained_tokenizer()
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    _write_gguf(base / "tiny.gguf", hf, tok)
    gguf_convert.convert(base / "tiny.gguf", base / "hf")
    return tok, hf, base / "hf"


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for heads in (1, 2, 3, 6):
        assert np.array_equal(unpermute_qk(permute_qk(w, heads), heads), w)
    # llama.cpp's permute interleaves the two halves of each head: rows [0, 3, 1, 4, 2, 5] for one head of 6
    assert permute_qk(np.arange(6.0)[:, None], 1)[:, 0].tolist() == [0, 3, 1, 4, 2, 5]
    with pytest.raises(ValueError, match="do not split"):
        unpermute_qk(np.zeros((10, 2), dtype=np.float32), 3)


def test_converted_weights_give_the_original_logits(converted):
    _tok, hf, folder = converted
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 16
    back = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 8]])
    with torch.no_grad():
        a, b = hf(input_ids=ids).logits, back(input_ids=ids).logits
    assert torch.max(torch.abs(a - b)).item() <= 1e-5


def test_converted_tokenizer_matches_the_original(converted):
    tok, _hf, folder = converted
    c = HFCounter(folder)
    for text in ["Paris 2024: 3.14159", "  12 months\n\n", "東京 你好，世界！", "def add(a, b):"]:
        assert c.encode_text(text) == tok.encode(text, add_special_tokens=False).ids, text
    # digits are single tokens (smollm pre-tokenizer), and specials are special
    ids = c.encode_text("365")
    assert len(ids) == 3
    assert c.tokenizer.encode("<|im_start|>", add_special_tokens=False).ids == [tok.token_to_id("<|im_start|>")]
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and tc["chat_template"] == TEMPLATE and tc["add_bos_token"] is False
    assert c.eos_token_ids == {tok.token_to_id("<|im_end|>")}
    assert c.prompt_prefix == [] and c.prompt_suffix == []  # no BOS added


def test_converter_refuses_what_it_cannot_convert(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        gguf_convert.convert(tmp_path / "x.gguf", tmp_path / "out")


# ---- pull failure paths (no network: the wheel is given, the pinned source replaced) ---------------------


def _fake_source(monkeypatch, wheel: Path, member: str = "pkg/model.gguf") -> None:
    src = model_store.ModelSource(
        package="fake",
        version="1",
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        member=member,
        verify_prompt="hi",
        verify_expect="x",
    )
    monkeypatch.setitem(model_store.MODELS, "fake-model", src)


def _leftovers(state: Path) -> list[str]:
    root = state / "models"
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) if root.exists() else []


def test_pull_with_a_wrong_checksum_leaves_nothing(tmp_path, capsys):
    wheel = tmp_path / "w.whl"
    wheel.write_bytes(b"not a wheel")
    state = tmp_path / "state"
    rc = model_store.main(["--state-dir", str(state), "pull", "smollm2-135m-instruct", "--wheel", str(wheel)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "SHA-256" in err and "partial or altered download" in err
    assert _leftovers(state) == []


def test_pull_of_a_truncated_wheel_leaves_nothing(tmp_path, monkeypatch, capsys):
    full = tmp_path / "full.whl"
    with zipfile.ZipFile(full, "w") as z:
        z.writestr("pkg/model.gguf", b"x" * 100_000)
    cut = tmp_path / "cut.whl"
    cut.write_bytes(full.read_bytes()[:5000])
    _fake_source(monkeypatch, cut)
    assert model_store.main(["--state-dir", str(tmp_path / "s"), "pull", "fake-model", "--wheel", str(cut)]) == 1
    assert "is not a complete wheel" in capsys.readouterr().err
    assert _leftovers(tmp_path / "s") == []


def test_pull_of_a_bad_gguf_fails_conversion_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/model.gguf", b"GGUF" + b"\0" * 64)
    _fake_source(monkeypatch, wheel)
    rc = model_store.main(["--state-dir", str(tmp_path / "s"), "pull", "fake-model", "--wheel", str(wheel)])
    assert rc == 1
    assert "pull failed" in capsys.readouterr().err
    assert _leftovers(tmp_path / "s") == []


def test_pull_refuses_unknown_names_and_foreign_folders(tmp_path, capsys):
    assert model_store.main(["--state-dir", str(tmp_path), "pull", "gpt-9"]) == 1
    assert "unknown model 'gpt-9'; known: smollm2-135m-instruct" in capsys.readouterr().err
    (tmp_path / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    assert model_store.main(["--state-dir", str(tmp_path), "pull", "smollm2-135m-instruct"]) == 1
    assert "is not a complete pull" in capsys.readouterr().err
    assert model_store.main(["--state-dir", str(tmp_path), "list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct        incomplete" in out


def test_kvgate_model_hands_off_to_the_backend_process(tmp_path):
    """``kvgate model list`` runs in ``python -m gpu_backend model`` (the gateway never imports it)."""
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "model", "--state-dir", str(tmp_path), "list"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].split()[:3] == ["smollm2-135m-instruct", "not", "pulled"]
