"""The OpenAI wire format: request validation (-> APIError with OpenAI's error body) and response objects.

Only what dsv3lite can honour is accepted: one choice (n=1), text content, no tools or logprobs. Unknown fields are
ignored, as OpenAI-compatible servers do; known fields with a bad type or value are a 400 naming the parameter.
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from dsv3lite.sampling import SEED_RANGE

MAX_STOP_STRINGS = 16
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers                # extra response headers (Allow on a 405, ...)
        self.type = type or ("server_error" if status >= 500 else "authentication_error" if status == 401
                             else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class GenerationRequest:
    """A validated chat or completion request."""
    sampling: dict                            # max_tokens (None: the context's room), temperature, top_p, top_k,
                                              # seed, stop
    stream: bool = False
    include_usage: bool = False
    messages: list[dict] | None = None        # chat
    prompt: str | list[int] | None = None     # completion


# --- field checks --------------------------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(name, f"'{name}' must be an integer, got {v!r}", "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad(name, f"'{name}' must be {rng}, got {v}")
    return v


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v):
        raise bad(name, f"'{name}' must be a number, got {v!r}", "invalid_type")
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad(name, f"'{name}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}")
    return float(v)


def _text(value: str, param: str) -> str:
    """A request string that has a UTF-8 form (JSON may escape a lone surrogate such as \\ud800, which has none)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(param, f"'{param}' is not valid Unicode: it holds a lone surrogate "
                         f"(\\u{ord(value[e.start]):04x}) at character {e.start}", "invalid_unicode") from None
    return value


def _bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(name, f"'{name}' must be true or false, got {v!r}", "invalid_type")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [_text(v, "stop")]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        if len(v) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(v)}")
        return [_text(s, "stop") for s in v]
    raise bad("stop", "'stop' must be a string or a list of strings", "invalid_type")


def check_model(body: dict, model_id: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad("model", f"'model' must be a string, got {model!r}", "invalid_type")
    if model != model_id:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{model_id}'", "model",
                       "model_not_found")


def _common(body: dict, defaults: dict, model_id: str) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object", "invalid_type")
    check_model(body, model_id)
    n = _int(body, "n")
    if n is not None and n != 1:
        raise bad("n", f"only n=1 is supported (one engine generates one reply at a time), got n={n}")
    for name in ("logprobs", "echo"):
        if body.get(name):
            raise bad(name, f"'{name}' is not supported by this server", "unsupported_parameter")
    if body.get("top_logprobs"):
        raise bad("top_logprobs", "'top_logprobs' is not supported by this server", "unsupported_parameter")
    max_tokens = _int(body, "max_tokens", lo=1)
    max_completion = _int(body, "max_completion_tokens", lo=1)
    sampling = {
        "max_tokens": max_completion or max_tokens or defaults.get("max_tokens"),    # None: up to the context
        "temperature": _pick(_number(body, "temperature", 0.0, 2.0), defaults.get("temperature", 0.0)),
        "top_p": _pick(_number(body, "top_p", 0.0, 1.0, lo_open=True), defaults.get("top_p", 1.0)),
        "top_k": _pick(_int(body, "top_k", lo=0), defaults.get("top_k", 0)),
        "seed": _pick(_int(body, "seed", *SEED_RANGE), defaults.get("seed")),
        "stop": _stop(body),
    }
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", "'stream_options' must be an object", "invalid_type")
    include_usage = bool(_bool(options or {}, "include_usage"))
    return GenerationRequest(sampling=sampling, stream=stream, include_usage=include_usage)


def _pick(value, default):
    return default if value is None else value


def _text_content(content, index: int, role: str) -> str:
    if content is None:
        if role == "assistant":
            return ""
        raise bad(f"messages[{index}].content", f"messages[{index}] ({role}) has no content")
    if isinstance(content, str):
        return _text(content, f"messages[{index}].content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(_text(part["text"], f"messages[{index}].content"))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"messages[{index}].content", f"only text content is supported, got a {kind!r} part")
        return "".join(parts)
    raise bad(f"messages[{index}].content", f"messages[{index}].content must be a string or a list of text parts",
              "invalid_type")


def parse_chat(body, defaults: dict, model_id: str) -> GenerationRequest:
    req = _common(body, defaults, model_id)
    if body.get("tools"):
        raise bad("tools", "tool calling is not supported by this server", "unsupported_parameter")
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise bad("response_format", f"response_format {fmt.get('type')!r} is not supported", "unsupported_parameter")
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects", "invalid_type")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with 'role' and 'content'", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        msg = {"role": "system" if role == "developer" else role, "content": _text_content(m.get("content"), i, role)}
        if isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = _text(m["reasoning_content"], f"messages[{i}].reasoning_content")
        out.append(msg)
    req.messages = out
    return req


def parse_completion(body, defaults: dict, model_id: str, vocab_size: int) -> GenerationRequest:
    req = _common(body, defaults, model_id)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "'prompt' is required", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                       # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(_is_int(t) for t in prompt):
            raise bad("prompt", "'prompt' must be a string, a list of token ids, or a list holding one of those",
                      "invalid_type")
        bad_ids = [t for t in prompt if not 0 <= t < vocab_size]
        if bad_ids:
            raise bad("prompt", f"token id {bad_ids[0]} is outside the vocabulary (0..{vocab_size - 1})")
    elif not isinstance(prompt, str):
        raise bad("prompt", "'prompt' must be a string or a list of token ids (one prompt per request)",
                  "invalid_type")
    else:
        _text(prompt, "prompt")
    req.prompt = prompt
    return req


# --- responses -----------------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_response(rid: str, created: int, model: str, content: str, reasoning: str | None, finish: str,
                  use: dict, with_reasoning: bool) -> dict:
    message = {"role": "assistant", "content": content}
    if with_reasoning:
        message["reasoning_content"] = reasoning
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": use}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None = None,
               with_usage_field: bool = False) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if with_usage_field:
        out["usage"] = None
    return out


def completion_response(rid: str, created: int, model: str, text: str, finish: str | None, use: dict | None,
                        obj_usage: bool = True) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if obj_usage:
        out["usage"] = use
    return out


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}
