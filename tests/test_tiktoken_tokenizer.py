"""Kimi-K2 / Moonlight tokenizers: a tokenizer.json built from tiktoken.model gives tiktoken's own ids, with
the special tokens of tokenizer_config.json at their ids; built once and cached; `convert-tokenizer` writes it."""
from __future__ import annotations

import base64
import json

import pytest

from dsv3lite.errors import UserError
from dsv3lite.tiktoken_convert import KIMI_PATTERN, merges_from_ranks
from dsv3lite.tokenizer import Tokenizer

tiktoken = pytest.importorskip("tiktoken")

TRAIN = ("The quick brown fox jumps over the lazy dog. 12345 apples and 678 pears!\n"
         "中文文本和English混合的句子。北京市 Pascal's code isn't done; we'll see.\n"
         "    indented\tlines\r\n\nwith   spaces and ÜNÏCÖDÉ, émigré café.\n") * 12
SPECIALS = {0: "[BOS]", 1: "[EOS]", 3: "<|im_end|>"}       # offsets past the vocabulary; 2 is an unlisted reserved id
TEXTS = ["Hello world", "中文English混合 and 北京市 Pascal", "1234567890 numbers 3.14159",
         "don't WE'LL they're", "  leading spaces\n\n\ttabs\r\n", "émigré café ÜNÏCÖDÉ", "x[EOS]y<|im_end|>",
         "a" * 40, "!!! ??? ... -- __ ~~", ""]


@pytest.fixture(scope="module")
def kimi_like(tmp_path_factory):
    """A checkpoint directory with only tiktoken.model + tokenizer_config.json, and tiktoken's encoder for it."""
    from tiktoken._educational import bpe_train

    ranks = bpe_train(TRAIN, 256 + 160, r"""'s|'t|'re|'ve|'m|'ll|'d| ?\w+| ?\d+| ?[^\s\w]+|\s+""", visualise=None)
    root = tmp_path_factory.mktemp("kimi")
    (root / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])))
    n = len(ranks)
    (root / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(n + i): {"content": t, "special": True} for i, t in SPECIALS.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]"}))
    specials = {t: n + i for i, t in SPECIALS.items()}
    return root, tiktoken.Encoding("kimi-like", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV3LITE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_ids_equal_tiktokens_and_round_trip(kimi_like):
    root, enc = kimi_like
    tok = Tokenizer.from_dir(root)
    for text in TEXTS:
        want = enc.encode(text, allowed_special="all")
        assert tok.encode(text) == want, text
        assert tok.decode(want) == text
    assert tok.encode(TRAIN) == enc.encode(TRAIN, allowed_special="all")


def test_special_tokens_keep_their_ids(kimi_like):
    root, enc = kimi_like
    tok = Tokenizer.from_dir(root)
    n = enc.n_vocab - (max(SPECIALS) + 1)                   # the first id past the tiktoken vocabulary
    assert tok.bos_id == n and tok.eos_id == n + 1 and tok.eos_id in tok.stop_ids
    assert tok.encode("<|im_end|>") == [n + 3]
    assert tok.encode("<|reserved_token_%d|>" % (n + 2)) == [n + 2]


def test_built_once_then_reused_from_the_cache(kimi_like, cache_dir):
    root, _ = kimi_like
    notes = []
    Tokenizer.from_dir(root, log=notes.append)
    built = list(cache_dir.rglob("tokenizer.json"))
    assert len(built) == 1 and any("tiktoken.model" in n for n in notes)
    stamp = built[0].stat().st_mtime_ns
    notes.clear()
    Tokenizer.from_dir(root, log=notes.append)
    assert notes == [] and built[0].stat().st_mtime_ns == stamp
    assert not (root / "tokenizer.json").exists()           # the checkpoint directory is left as it is


def test_convert_tokenizer_command_writes_it_next_to_the_model(kimi_like, tmp_path, capsys):
    import shutil

    from dsv3lite.cli import main

    root, enc = kimi_like
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root, ckpt)
    (ckpt / "config.json").write_text("{}")
    assert main(["convert-tokenizer", str(ckpt)]) == 0
    assert (ckpt / "tokenizer.json").is_file() and "tokenizer.json" in capsys.readouterr().err
    assert Tokenizer.from_dir(ckpt).encode(TEXTS[1]) == enc.encode(TEXTS[1])
    assert main(["convert-tokenizer", str(ckpt)]) != 0                 # an existing tokenizer.json needs --force
    assert "--force" in capsys.readouterr().err
    assert main(["convert-tokenizer", str(ckpt), "--force"]) == 0


def test_merges_are_ordered_by_the_rank_of_the_token_they_make():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert merges_from_ranks(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]


def test_bad_tiktoken_model_is_one_clear_line(tmp_path):
    (tmp_path / "tiktoken.model").write_text("not-base64!! 0\n")
    with pytest.raises(UserError, match="tiktoken.model"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYg== 5\n")
    with pytest.raises(UserError, match="ranks must be"):
        Tokenizer.from_dir(tmp_path)
