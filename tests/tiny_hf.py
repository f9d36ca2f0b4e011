"""A tiny Hugging Face Llama folder for tests (test helper): a random ``LlamaForCausalLM`` (2 layers,
hidden 64) and a byte-level BPE tokenizer trained with ``tokenizers`` that differs from SmolLM2's and
from the bundled one: a BOS ``<s>`` added to completions prompts, a Zephyr-style chat template,
``</s>`` as ``eos_token`` and ``<|endoftext|>`` (id 0) as a second EOS only in
``generation_config.json``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 東京は日本の首都です。",
    "for i in range(10):\n    print(i * i)\n",
] * 30


def build_folder(folder: Path, *, silent: bool, context_length: int = 1024) -> None:
    """Write a tiny HF Llama folder at ``folder`` (created; must not exist): ``tokenizer.json``,
    ``tokenizer_config.json`` (chat template, ``</s>`` as EOS), ``config.json`` +
    ``model.safetensors`` (seeded random, ``max_position_embeddings = context_length``) and
    ``generation_config.json`` (EOS ids ``[</s>, 0]``). ``silent``: the final norm is zeroed, so
    every logit is 0 and greedy decoding picks id 0 (``<|endoftext|>``) at once."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "chat_template": TEMPLATE,
                "add_bos_token": True,
            }
        )
    )
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context_length,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=tok.token_to_id("</s>"),
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    if silent:
        with torch.no_grad():
            model.model.norm.weight.zero_()
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.token_to_id("</s>"), 0]}))
    assert SPECIALS.index("<|endoftext|>") == tok.token_to_id("<|endoftext|>") == 0
