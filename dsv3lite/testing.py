"""Tiny checkpoints for tests and benchmarks, written with transformers (the oracle) and `tokenizers`.

Nothing here downloads anything: models are random, tokenizers are trained on a built-in text.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT]

# DeepSeek-V3-style template: system text first, then User/Assistant turns; assistant turns end with EOS.
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + message['content'] %}{% endif %}{% endfor %}"
    "{{ bos_token }}{{ ns.system }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
To be, or not to be, that is the question. All the world's a stage, and all the men and women merely players.
Mixture-of-experts models route every token to a few experts; the router picks them by score.
Numbers like 12345 and 3.14159 appear in text, as do symbols: #, $, %, &, (parentheses) and "quotes".
Ünïcödé text: café, naïve, 東京, Москва, emoji 🙂 and accents é à ü ö ß.
"""


def write_tokenizer(path: str | os.PathLike, vocab_size: int = 400, chat_template: str = CHAT_TEMPLATE,
                    template_file: bool = False) -> Path:
    """Train a small byte-level BPE with DeepSeek-style special tokens and write tokenizer files into `path`.

    template_file=True writes the chat template to chat_template.jinja instead of tokenizer_config.json.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TRAINING_TEXT.splitlines() * 4, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 16384,
    }
    if template_file:
        (path / "chat_template.jinja").write_text(chat_template)
    else:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return path
