"""Tokenizer tests: transformers' fast tokenizer on the same files is the oracle for ids, text and chat rendering."""
import json

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from dsv3lite.errors import UserError
from dsv3lite.testing import ASSISTANT, BOS, CHAT_TEMPLATE, EOS, USER, write_tokenizer
from dsv3lite.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces  \n\ttabs and\r\nnewlines\n\n",
    "Ünïcödé text: café, naïve, 東京, Москва, emoji 🙂 and accents é à ü ö ß.",
    "never seen: 🎉🚀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ﷺ עברית हिन्दी 👩‍👩‍👧",
    f"{BOS}specials{USER} in the text {ASSISTANT}too{EOS}",
    "numbers 12345 3.14159 #$%&()\"quotes\"",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Und auf Deutsch? 🙂"}],
    [{"role": "user", "content": "東京"}, {"role": "assistant", "content": "Tokyo", "reasoning": "translate"},
     {"role": "user", "content": "again", "name": None}],
]

# Exercises what transformers' template environment adds: whitespace control, loop controls, namespace, its tojson,
# {% generation %}, raise_exception, strftime_now, dict(), the special-token variables and message normalisation.
FEATURE_TEMPLATE = """\
{%- set ns = namespace(sys='', n=0) %}
{% for m in messages %}
    {% if m.role == 'system' %}
        {% set ns.sys = m.content %}
        {% continue %}
    {% endif %}
    {% set ns.n = ns.n + 1 %}
{% endfor %}
{{ bos_token }}{{ ns.sys }}
{% if tools %}
Tools: {{ tools | tojson }}
{% endif %}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {% if m.role not in ['user', 'assistant'] %}{{ raise_exception('unknown role: ' + m.role) }}{% endif %}
    {% if m.role == 'user' %}
<｜User｜>{% if m.name is defined %}({{ m.name }}) {% endif %}{{ m.content }}
    {% else %}
<｜Assistant｜>{% if m.reasoning_content is defined %}<think>{{ m.thinking }}</think>{% endif %}
{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}
    {% endif %}
    {% if loop.index >= 5 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<｜Assistant｜>{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}
{% endif %}
{{ {'n': ns.n, 'meta': {'q': 'a<b & "c"', 'é': [1, 2.5, none, true]}} | tojson(indent=2) }}
{{ dict(a=1, b='ü') | tojson }} {{ strftime_now('%Y') }}
{{ pad_token | default('nopad') }}|{{ image_token | default('noimg') }}|{{ unk_token is defined }}
"""


def hf(path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def edit_config(path, **changes):
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_file.write_text(json.dumps(config, ensure_ascii=False))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def pair(tok_dir):
    return Tokenizer.from_dir(tok_dir), hf(tok_dir)


# ---- encode / decode

@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(pair, text):
    ours, ref = pair
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text == ref.decode(ids)
    assert ours.decode(ids, skip_special=True) == ref.decode(ids, skip_special_tokens=True)


def test_special_ids_and_vocab_match_transformers(pair):
    ours, ref = pair
    assert ours.vocab_size == len(ref)
    assert (ours.bos_id, ours.eos_id) == (ref.bos_token_id, ref.eos_token_id)
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)
    assert ours.stop_ids == {ref.eos_token_id}


def test_bos_only_when_asked_and_never_twice(pair):
    ours, _ = pair
    assert ours.bos_id not in ours.encode("hello")
    assert ours.encode("hello", add_bos=True) == [ours.bos_id] + ours.encode("hello")
    assert ours.encode(BOS + "hello", add_bos=True) == ours.encode(BOS + "hello")
    assert ours.encode("", add_bos=True) == [ours.bos_id]


def test_out_of_range_ids_decode_to_nothing(pair):
    ours, _ = pair
    n = ours.vocab_size
    for bad in (n, n + 100, 129279, 2**40, -1):
        assert ours.decode([bad]) == ""
    ids = ours.encode("hello world")
    assert ours.decode([n] + ids + [n + 100, 2**70]) == ours.decode(ids)


def test_config_variants_match_transformers(tmp_path):
    write_tokenizer(tmp_path)
    added = {"__type": "AddedToken", "content": BOS, "lstrip": False, "rstrip": False, "normalized": False,
             "single_word": False, "special": True}
    edit_config(tmp_path, bos_token=added)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 3]}))
    ours, ref = Tokenizer.from_dir(tmp_path), hf(tmp_path)
    assert (ours.bos_token, ours.bos_id) == (ref.bos_token, ref.bos_token_id)
    assert ours.stop_ids == {ref.eos_token_id, ref.convert_tokens_to_ids(ASSISTANT)}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert Tokenizer.from_dir(tmp_path).stop_ids == {ref.eos_token_id, ref.convert_tokens_to_ids(USER)}


# ---- chat templates

@pytest.mark.parametrize("template_file", [False, True], ids=["tokenizer_config", "chat_template.jinja"])
@pytest.mark.parametrize("template", [CHAT_TEMPLATE, FEATURE_TEMPLATE], ids=["deepseek", "features"])
def test_chat_rendering_matches_transformers(tmp_path, template_file, template):
    write_tokenizer(tmp_path, chat_template=template, template_file=template_file)
    edit_config(tmp_path, pad_token=EOS, image_token=USER)  # tokens in the vocab: transformers adds unknown ones
    ours, ref = Tokenizer.from_dir(tmp_path), hf(tmp_path)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
            expected_ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen,
                                                   return_dict=False)
            assert ours.encode_chat(messages, add_generation_prompt=gen) == expected_ids
    extra = {"enable_thinking": True, "tools": [{"type": "function", "function": {"name": "f<x>", "d": "ü"}}]}
    expected = ref.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True, **extra)
    assert ours.apply_chat_template(CONVERSATIONS[1], **extra) == expected


def test_template_file_wins_over_tokenizer_config(tmp_path):
    write_tokenizer(tmp_path, chat_template=FEATURE_TEMPLATE, template_file=True)
    edit_config(tmp_path, chat_template="{{ 'from config' }}")
    ours, ref = Tokenizer.from_dir(tmp_path), hf(tmp_path)
    expected = ref.apply_chat_template(CONVERSATIONS[2], tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CONVERSATIONS[2]) == expected
    assert "from config" not in expected


def test_named_template_list_matches_transformers(tmp_path):
    write_tokenizer(tmp_path)
    edit_config(tmp_path, chat_template=[{"name": "default", "template": CHAT_TEMPLATE},
                                         {"name": "tool_use", "template": FEATURE_TEMPLATE}])
    ours, ref = Tokenizer.from_dir(tmp_path), hf(tmp_path)
    messages = CONVERSATIONS[1]
    plain = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == plain
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    with_tools = ref.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, tools=tools) == with_tools != plain


def test_raise_exception_becomes_user_error(tmp_path):
    write_tokenizer(tmp_path, chat_template=FEATURE_TEMPLATE)
    messages = [{"role": "tool", "content": "42"}]
    with pytest.raises(Exception, match="unknown role: tool"):  # the oracle fails the same way
        hf(tmp_path).apply_chat_template(messages, tokenize=False)
    with pytest.raises(UserError, match="unknown role: tool"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(messages)


def test_sandbox_refuses_unsafe_templates(tmp_path):
    write_tokenizer(tmp_path, chat_template="{% set ns = namespace() %}{% set ns._x = 1 %}{{ ''.__class__ }}")
    with pytest.raises(UserError, match="underscore"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATIONS[0])
    write_tokenizer(tmp_path, chat_template="{{ messages.append(1) }}")
    with pytest.raises(UserError, match="chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATIONS[0])


# ---- streaming

def stream(tokenizer, ids, skip_special=True):
    decoder = tokenizer.stream_decoder(skip_special=skip_special)
    chunks = [decoder.push(i) for i in ids]
    chunks.append(decoder.flush())
    assert "".join(chunks) == decoder.text
    return chunks


@pytest.mark.parametrize("skip_special", [True, False])
def test_stream_equals_full_decode_without_broken_characters(pair, skip_special):
    ours, _ = pair
    text = " ".join(TEXTS)
    ids = ours.encode(text)
    # the test is only meaningful if some tokens hold part of a UTF-8 character
    assert any("\ufffd" in ours.decode([i]) for i in ids)
    chunks = stream(ours, ids, skip_special)
    assert "".join(chunks) == ours.decode(ids, skip_special=skip_special)
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_stream_ignores_out_of_range_ids(pair):
    ours, _ = pair
    ids = ours.encode("café 🎉 ok")
    noisy = [ours.vocab_size] + ids[:3] + [ours.vocab_size + 100, 2**40] + ids[3:]
    assert "".join(stream(ours, noisy)) == ours.decode(ids)


def test_stream_keeps_context_dependent_spaces():
    # SentencePiece-style decoding drops the leading space of the first token only: decoding token by token would
    # lose every space; the decoding window must keep them.
    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4, trainer=trainer)
    tokenizer = Tokenizer(backend)
    ids = tokenizer.encode("the lazy fox jumps over the quick dog")
    assert tokenizer.decode(ids[1:2]) != tokenizer.decode(ids[:2])[len(tokenizer.decode(ids[:1])):]
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids) == "the lazy fox jumps over the quick dog"


# ---- errors

def assert_user_error(call, *fragments):
    with pytest.raises(UserError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_missing_directory(tmp_path):
    assert_user_error(lambda: Tokenizer.from_dir(tmp_path / "nope"), str(tmp_path / "nope"), "not found")


def test_missing_tokenizer_json(tmp_path):
    assert_user_error(lambda: Tokenizer.from_dir(tmp_path), str(tmp_path), "tokenizer.json")


def test_tiktoken_only_directory_with_a_damaged_model(tmp_path, monkeypatch):
    # a tiktoken-only directory is converted (tests/test_tiktoken_tokenizer.py); a damaged model is one line
    monkeypatch.setenv("DSV3LITE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "tiktoken.model").write_text("aGVsbG8= 0\naGVsbG8= x\n")
    assert_user_error(lambda: Tokenizer.from_dir(tmp_path), str(tmp_path), "tiktoken.model")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_corrupt_json(tmp_path, name):
    write_tokenizer(tmp_path)
    (tmp_path / name).write_text('{"model": {"type": "BPE", ')
    assert_user_error(lambda: Tokenizer.from_dir(tmp_path), str(tmp_path / name))


def test_no_chat_template(tmp_path):
    write_tokenizer(tmp_path)
    edit_config(tmp_path, chat_template=None)
    with pytest.raises(ValueError):  # the oracle has no template either
        hf(tmp_path).apply_chat_template(CONVERSATIONS[0], tokenize=False)
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.decode(ours.encode("still encodes")) == "still encodes"
    assert_user_error(lambda: ours.apply_chat_template(CONVERSATIONS[0]), str(tmp_path), "no chat template")
    assert_user_error(lambda: ours.encode_chat(CONVERSATIONS[0]), "no chat template")
