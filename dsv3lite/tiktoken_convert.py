"""Kimi-K2 / Moonlight tokenizers: a Hugging Face `tokenizer.json` built from the checkpoint's `tiktoken.model`
(base64 token and rank per line) and the special tokens of its `tokenizer_config.json`.

tiktoken encodes a pre-token that is itself a token directly, and otherwise merges the adjacent pair whose
concatenation has the lowest rank. A byte-level BPE whose merges are ordered by the rank of the token they make
(and that looks a whole pre-token up first: `ignore_merges`) gives the same ids; the pre-tokenizer is Kimi's
split pattern. Built once per source and cached (`tokenizer_cache_dir()`), or written next to the checkpoint by
`dsv3lite convert-tokenizer DIR`.
"""
from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from .errors import UserError

TIKTOKEN_FILE = "tiktoken.model"
# Kimi's pre-tokenizer split (its tokenization_kimi.py): Han runs on their own, letters without Han, numbers of
# up to three digits, punctuation runs, newlines, spaces
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68 for code points 256..."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_ranks(path: Path) -> dict[bytes, int]:
    """token bytes -> rank from a tiktoken model file."""
    ranks: dict[bytes, int] = {}
    try:
        lines = Path(path).read_bytes().splitlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    if not ranks or sorted(ranks.values()) != list(range(len(ranks))):
        raise UserError(f"{path} is not a tiktoken model: ranks must be 0..{len(ranks) - 1} once each")
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of each multi-byte token into two tokens, ordered by the rank of the token they make."""
    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def special_tokens(config: dict, first_id: int) -> list[tuple[int, str]]:
    """(id, text) of the special tokens in tokenizer_config.json's added_tokens_decoder, ids from `first_id` on
    without gaps (Kimi's unlisted reserved ids get placeholder names)."""
    listed = {int(i): (v["content"] if isinstance(v, dict) else str(v))
              for i, v in (config.get("added_tokens_decoder") or {}).items()}
    if not listed:
        return []
    if min(listed) < first_id:
        raise UserError(f"special token id {min(listed)} overlaps the tiktoken vocabulary (0..{first_id - 1})")
    return [(i, listed.get(i, f"<|reserved_token_{i}|>")) for i in range(first_id, max(listed) + 1)]


def build_tokenizer_json(tiktoken_path: Path, config: dict, pattern: str = KIMI_PATTERN) -> str:
    """The tokenizer.json text for a tiktoken model plus its tokenizer_config.json."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks = read_ranks(tiktoken_path)
    alphabet = byte_to_unicode()
    text = lambda b: "".join(alphabet[x] for x in b)
    vocab = {text(t): r for t, r in ranks.items()}
    merges = [(text(a), text(b)) for a, b in merges_from_ranks(ranks)]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = special_tokens(config, len(ranks))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in specials])
    for i, t in specials:
        if tok.token_to_id(t) != i:
            raise UserError(f"special token {t!r} would get id {tok.token_to_id(t)}, not {i}: duplicate names?")
    return tok.to_str()


def tokenizer_cache_dir() -> Path:
    """Where converted tokenizers are kept: utils.cache_root()/tokenizers."""
    from .utils import cache_root

    return cache_root() / "tokenizers"


def converted_tokenizer(checkpoint: Path, config: dict, log=None) -> Path:
    """A tokenizer.json for a checkpoint that ships only tiktoken.model (config: its tokenizer_config.json): built
    on first use, then reused from the cache (keyed by the bytes of tiktoken.model and tokenizer_config.json)."""
    src, cfg = checkpoint / TIKTOKEN_FILE, checkpoint / "tokenizer_config.json"
    digest = hashlib.sha256(src.read_bytes() + b"\0" + (cfg.read_bytes() if cfg.is_file() else b"")).hexdigest()
    out = tokenizer_cache_dir() / digest[:24] / "tokenizer.json"
    if out.is_file():
        return out
    if log:
        log(f"note: {checkpoint} ships only {TIKTOKEN_FILE}: building a tokenizer.json from it (once; cached in "
            f"{out.parent})")
    write_atomic(out, build_tokenizer_json(src, config))
    return out


def write_atomic(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None
