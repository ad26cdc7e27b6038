"""Tokenizer: a checkpoint's tokenizer.json, its special tokens and its chat template, plus streaming detokenization.

Encoding and decoding run on the `tokenizers` library. Chat templates render with jinja2 in the same sandboxed
environment transformers builds (trim_blocks, lstrip_blocks, loop controls, its `tojson`, `raise_exception`,
`strftime_now`, and the special tokens as variables), so a prompt is byte-for-byte what transformers would render.
transformers itself is not needed at run time.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
from tokenizers import Tokenizer as Backend

from .errors import UserError

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # names a message's reasoning may come under
_SURROGATES = re.compile("[\ud800-\udfff]")


def replace_undecodable(text: str) -> tuple[str, int]:
    """`text` with every lone surrogate (an undecodable input byte as Python's surrogateescape keeps it, or a
    "\\ud800" escape from JSON) replaced by U+FFFD -> (text, how many were replaced). Such text has no UTF-8 form,
    so the tokenizer could not take it."""
    return _SURROGATES.subn("\ufffd", text)


class Tokenizer:
    """Encode/decode text and render chats for one checkpoint directory."""

    def __init__(self, backend: Backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 extra_stop_ids: Iterable[int] = (), chat_templates: Mapping[str, str] | None = None,
                 template_vars: Mapping[str, str] | None = None, source: str = "tokenizer"):
        self._backend = backend
        self.source = source                                     # where it came from, for error messages
        known_ids = backend.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(known_ids, default=-1) + 1         # ids past this (padded embedding rows) decode to ""
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self.eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        self.stop_ids = set(extra_stop_ids) | ({self.eos_id} if self.eos_id is not None else set())
        self.chat_templates = dict(chat_templates or {})         # name -> template; a single template is "default"
        self.chat_template = self.chat_templates.get("default")
        self.template_vars = dict(template_vars or {})           # bos_token, eos_token, ... as the template sees them
        self._env = None
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_dir(cls, path, log=None) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json from `path`.
        A checkpoint that ships only tiktoken.model (Kimi-K2, Moonlight) gets a tokenizer.json built from it once
        and cached (see tiktoken_convert), with a note through `log`."""
        path = Path(path)
        if not path.is_dir():
            raise UserError(f"tokenizer directory not found: {path}")
        config = read_json(path / "tokenizer_config.json")
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            if not (path / "tiktoken.model").is_file():
                raise UserError(f"no tokenizer.json in {path}")
            from .tiktoken_convert import converted_tokenizer
            tokenizer_file = converted_tokenizer(path, config, log)
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception with serde's message
            raise UserError(f"cannot read {tokenizer_file}: {_one_line(e)}") from None

        if "added_tokens_decoder" not in config:
            # Older checkpoints keep their special tokens in special_tokens_map.json; transformers lets it override.
            config.update(read_json(path / "special_tokens_map.json"))
        template_vars = _special_token_vars(config)
        generation = read_json(path / "generation_config.json")
        stop = generation.get("eos_token_id")
        stop_ids = [stop] if isinstance(stop, int) else [i for i in stop or () if isinstance(i, int)]
        return cls(backend, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")), extra_stop_ids=stop_ids,
                   chat_templates=_chat_templates(path, config), template_vars=template_vars, source=str(path))

    # ---- text <-> ids

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in it become special tokens; BOS only when asked. Lone
        surrogates (undecodable input) encode as U+FFFD."""
        ids = self._backend.encode(replace_undecodable(text)[0], add_special_tokens=False).ids
        if add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        """Text of `ids`; ids the tokenizer does not know (negative, or past vocab_size) decode to ""."""
        known = [i for i in map(int, ids) if 0 <= i < self.vocab_size]
        return self._backend.decode(known, skip_special_tokens=skip_special)

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    # ---- chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Render `messages` with the checkpoint's chat template, exactly as transformers' apply_chat_template does
        with tokenize=False. `extra` reaches the template as variables (tools=, documents=, and the like)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise UserError("a chat needs a non-empty list of messages")
        tools, documents = extra.pop("tools", None), extra.pop("documents", None)
        template = self._pick_template(with_tools=tools is not None)
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise UserError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
            # transformers drops None-valued keys (OpenAI clients send content=None) and aliases reasoning fields
            message = _plain({k: v for k, v in message.items() if v is not None})
            reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise UserError("tools must be JSON schemas (dicts)")
        variables = {**self.template_vars, **_plain(extra)}   # caller's values win over the special tokens
        try:
            return self._compile(template).render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                                  add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise UserError(f"chat template of {self.source}: {_one_line(e)}") from None
        except (TypeError, ValueError, KeyError, IndexError) as e:
            raise UserError(f"chat template of {self.source} failed on these messages: {_one_line(e)}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Ids of the rendered chat. The template writes the BOS text itself, so none is added here."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))

    def _pick_template(self, with_tools: bool) -> str:
        if not self.chat_templates:
            raise UserError(f"{self.source} has no chat template (tokenizer_config.json chat_template or "
                            "chat_template.jinja); use plain text generation instead")
        if with_tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" not in self.chat_templates:
            names = ", ".join(sorted(self.chat_templates))
            raise UserError(f"{self.source} has several chat templates ({names}) and none named 'default'")
        return self.chat_templates["default"]

    def _compile(self, template: str) -> jinja2.Template:
        if template not in self._compiled:
            if self._env is None:
                self._env = _template_environment()
            try:
                self._compiled[template] = self._env.from_string(template)
            except jinja2.TemplateSyntaxError as e:
                raise UserError(f"chat template of {self.source} is not valid Jinja (line {e.lineno}): "
                                f"{_one_line(e)}") from None
        return self._compiled[template]


class StreamDecoder:
    """Incremental detokenization: push ids one at a time, get back only new, complete text.

    Each push decodes a short window of recent ids twice, with and without the newest ones, and emits the
    difference. Text ending in U+FFFD is held back, since a byte-level token can carry half of a UTF-8 character;
    the window starts where earlier output ended, so tokens that change how their neighbours decode (SentencePiece's
    leading space) cannot alter text already emitted.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.ids: list[int] = []
        self.text = ""             # everything emitted so far
        self._prefix_offset = 0    # window start: ids before it are fully emitted
        self._read_offset = 0      # ids before it are emitted; ids[prefix:read] give the window's context text

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        seen = decode(self.ids[self._prefix_offset:self._read_offset], self.skip_special)
        current = decode(self.ids[self._prefix_offset:], self.skip_special)
        if len(current) <= len(seen) or (current.endswith("\ufffd") and not final):
            return ""
        new = current[len(seen):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self.text += new
        return new


# ---- loading helpers

def _one_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{file} is not valid JSON: {_one_line(e)}") from None
    if not isinstance(data, dict):
        raise UserError(f"{file} should hold a JSON object, found {type(data).__name__}")
    return data


def _token_text(value) -> str | None:
    """A special token as configs write it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_token_vars(config: Mapping) -> dict[str, str]:
    """The variables transformers hands a chat template: every `*_token` entry (bos_token, eos_token, pad_token,
    model-specific ones like image_token) plus a named extra_special_tokens mapping."""
    named = {k: v for k, v in config.items() if k.endswith("_token")}
    for key in ("extra_special_tokens", "additional_special_tokens"):
        if isinstance(config.get(key), Mapping):
            named.update(config[key])
    return {k: text for k, v in named.items() if (text := _token_text(v)) is not None}


def _chat_templates(path: Path, config: Mapping) -> dict[str, str]:
    """Template files (chat_template.jinja, additional_chat_templates/*.jinja) replace tokenizer_config's entry."""
    from_files = {}
    if (path / "chat_template.jinja").is_file():
        from_files["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            from_files[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if from_files:
        return from_files
    template = config.get("chat_template")
    if isinstance(template, str):
        return {"default": template}
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        try:
            return {t["name"]: t["template"] for t in template}
        except (TypeError, KeyError):
            raise UserError(f"{path / 'tokenizer_config.json'}: chat_template list entries need "
                            "'name' and 'template'") from None
    if isinstance(template, Mapping):
        return dict(template)
    return {}


# ---- the template sandbox (what transformers' chat templates expect to find)

def _plain(value):
    """Rebuild template input from plain JSON-like types; anything else becomes an inert "<TypeName>" string, so the
    sandbox never sees methods of rich objects (transformers does the same)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models, e.g. OpenAI SDK messages
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; it renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _check_namespace_key(name):
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates may not set underscore attributes ({name!r})")


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore-prefixed names (a way towards CPython internals)."""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_namespace_key(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_namespace_key(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _TemplateDict:
    """`dict(...)` for templates without handing them the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Plain json.dumps: jinja's own tojson escapes <, >, & and ' for HTML, which chat templates must not do.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env
