"""SmolLM2-135M-Instruct, pulled and converted for real (marked ``real_model``; one pull per session,
see tests/real_model_support.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenizer.hf_counter import HFCounter

pytestmark = pytest.mark.real_model
pytest_plugins = ["real_model_support"]  # the session fixtures smollm2, smollm2_state
ROOT = Path(__file__).resolve().parent.parent
NAME = "smollm2-135m-instruct"

#: text -> ids. Where they come from: transformers 5.24's own GGUF tokenizer converter
#: (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) gives these ids for every string but
#: "  3.14159 is pi"; for that one it gives [216, 216, 35, ...], because its converter leaves out
#: the ``smollm`` pre-tokenizer's digit split, whereas llama.cpp (``llama-vocab.cpp``: regex
#: ``\p{N}`` first, then the GPT-2 regex) keeps the two spaces together as one piece ("ĠĠ", 256), as
#: does the Hub's SmolLM2 tokenizer.json (``Digits(individual_digits)`` then ``ByteLevel``).
KNOWN_IDS = {
    "Hello world": [19556, 905],
    "12345 apples": [33, 34, 35, 36, 37, 13855],  # digits one by one ('0' is 32)
    "  3.14159 is pi": [256, 35, 30, 33, 36, 33, 37, 41, 314, 16916],
    "你好，世界": [18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230],
    "2024年12月1日": [34, 32, 34, 36, 32090, 129, 33, 34, 14483, 226, 33, 23274, 115],
    "héllo wörld 🙂": [88, 2756, 31394, 267, 29989, 400, 47526],
}


def test_converted_tokenizer_gives_known_ids(smollm2):
    c = HFCounter(smollm2)
    for text, ids in KNOWN_IDS.items():
        assert c.tokenizer.encode(text, add_special_tokens=False).ids == ids, text
        assert c.encode_prompt_text(text) == ids, text  # no BOS is added
        assert b"".join(c.token_bytes(i) for i in ids).decode() == text
    # control tokens are special: one id when the template writes them, text when a user does
    assert c.tokenizer.encode("<|im_start|>", add_special_tokens=False).ids == [1]
    assert c.encode_text("<|im_start|>") == [44, 108, 306, 79, 3738, 108, 46]
    assert c.count_text("<|im_start|>") == 7
    assert c.eos_token_ids == {2} and c.tokenizer.id_to_token(2) == "<|im_end|>"
    assert len(c.special_ids) == 17 and c.special_ids == set(range(17))


def test_pull_verified_and_is_idempotent(smollm2, smollm2_state):
    man = json.loads((smollm2 / "kvgate-model.json").read_text())
    assert "Paris" in man["verified_reply"] and man["context_length"] == 8192
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        30,
        576,
        9,
        3,
    )
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True and cfg["eos_token_id"] == 2
    before = {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "gateway.cli", "model", "--state-dir", str(smollm2_state)]
    r = subprocess.run([*cmd, "pull", NAME], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and f"{NAME} is already present" in r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()} == before
    r = subprocess.run([*cmd, "list"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.stdout.splitlines()[1].split()[:2] == [NAME, "present"]
