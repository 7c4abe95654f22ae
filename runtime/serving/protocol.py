"""The OpenAI wire format: request bodies checked into a `ServeRequest`, and the response and stream-chunk
objects. Every refusal is an `ApiError` (status, OpenAI-style error object naming the field), so nothing a
client sends reaches the engine unchecked or comes back as a traceback.

Honoured: model, prompt / messages, max_tokens (max_completion_tokens), temperature, seed, stop (strings
or token ids), n = 1, stream (+ stream_options.include_usage), echo. Fields that only have a neutral value
here (top_p 1, penalties 0, logprobs off, ...) are accepted at that value; any other value, and any
unknown field, is a 400 naming it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from ..requests import SEED_RANGE

MAX_STOP, MAX_STOP_CHARS, MAX_JSON_DEPTH = 16, 256, 64


class ApiError(Exception):
    """A request refused with an HTTP status and an OpenAI-style error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass
class ServeRequest:
    """A checked completions or chat request (prompt still text or ids; the app tokenizes)."""

    chat: bool
    model: str | None
    prompt: str | list[int] | None = None
    messages: list[Any] | None = None
    max_tokens: int | None = None  # None: the endpoint's default
    temperature: float = 1.0
    seed: int | None = None  # None: the server picks one (and reports it)
    stop_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; 400 for anything else (NaN/Infinity and deep nesting too)."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise bad("request body nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"request body is not valid JSON: {str(exc)[:120]}") from None
    if not isinstance(value, dict):
        raise bad(f"request body must be a JSON object, got {type(value).__name__}")
    if _depth(value) > MAX_JSON_DEPTH:
        raise bad("request body nests too deeply")
    return value


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _depth(value: object, level: int = 0) -> int:
    if level > MAX_JSON_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level


# field -> the values accepted because they change nothing here
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (None, 1, 1.0), "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "logprobs": (None, False, 0), "top_logprobs": (None, 0), "best_of": (None, 1),
    "suffix": (None, ""), "n": (None, 1), "tools": (None, []), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, True, False),
}
_COMMON = ("model", "max_tokens", "temperature", "seed", "stop", "stream", "stream_options", "user", "n", "top_p",
           "frequency_penalty", "presence_penalty", "logit_bias", "logprobs")
COMPLETION_FIELDS = frozenset((*_COMMON, "prompt", "echo", "best_of", "suffix"))
CHAT_FIELDS = frozenset((*_COMMON, "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "response_format", "parallel_tool_calls"))


def completion_request(body: dict[str, Any], max_tokens_limit: int) -> ServeRequest:
    _check_fields(body, COMPLETION_FIELDS)
    request = _common(body, chat=False, max_tokens_limit=max_tokens_limit)
    request.prompt = _prompt(body.get("prompt"))
    request.echo = _bool(body, "echo")
    return request


def chat_request(body: dict[str, Any], max_tokens_limit: int) -> ServeRequest:
    _check_fields(body, CHAT_FIELDS)
    request = _common(body, chat=True, max_tokens_limit=max_tokens_limit)
    if "max_completion_tokens" in body:
        other = _max_tokens(body, "max_completion_tokens", max_tokens_limit)
        if request.max_tokens is not None and other is not None and other != request.max_tokens:
            raise bad("max_tokens and max_completion_tokens disagree", "max_completion_tokens")
        request.max_tokens = other if other is not None else request.max_tokens
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    request.messages = messages  # checked in full by the chat template's renderer
    return request


def _check_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    for name, value in body.items():
        if name not in known:
            raise bad(f"unknown or unsupported field '{name}'", name)
        if name in _NEUTRAL and value not in _NEUTRAL[name]:
            only = ", ".join(json.dumps(v) for v in _NEUTRAL[name])
            raise bad(f"'{name}' is not supported by this server (accepted values: {only})", name)


def _common(body: dict[str, Any], *, chat: bool, max_tokens_limit: int) -> ServeRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise bad("user must be a string", "user")
    request = ServeRequest(chat=chat, model=model, max_tokens=_max_tokens(body, "max_tokens", max_tokens_limit))
    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not math.isfinite(temperature):
            raise bad("temperature must be a number", "temperature")
        if not 0.0 <= temperature <= 2.0:
            raise bad(f"temperature must lie in [0, 2], got {temperature}", "temperature")
        request.temperature = float(temperature)
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            raise bad("seed must be an integer in [-2**63, 2**64)", "seed")
        request.seed = seed
    request.stop_ids, request.stop_strings = _stop(body.get("stop"))
    request.stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not request.stream:
            raise bad("stream_options needs stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options may only hold include_usage", "stream_options")
        request.include_usage = _bool(options, "include_usage", "stream_options.include_usage")
    return request


def _max_tokens(body: dict[str, Any], name: str, limit: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer", name)
    if not 1 <= value <= limit:
        raise bad(f"{name} must lie in [1, {limit}] on this server, got {value}", name)
    return value


def _bool(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"{param or name} must be true or false", param or name)
    return value


def _prompt(prompt: object) -> str | list[int]:
    """One prompt: text, token ids, or a one-element list of either (n = 1: no batches)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise bad("one prompt per request on this server (no batched prompts)", "prompt")
    raise bad("prompt must be a non-empty string or a non-empty list of token ids", "prompt")


def _stop(stop: object) -> tuple[list[int], list[str]]:
    """None, a string, or a list of strings and/or token ids."""
    if stop is None:
        return [], []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or len(items) > MAX_STOP:
        raise bad(f"stop must be a string or a list of at most {MAX_STOP} strings or token ids", "stop")
    ids, strings = [], []
    for item in items:
        if isinstance(item, str) and 0 < len(item) <= MAX_STOP_CHARS:
            strings.append(item)
        elif isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            ids.append(item)
        else:
            raise bad(f"each stop must be a string of 1..{MAX_STOP_CHARS} characters or a token id >= 0", "stop")
    return ids, strings


# -- responses ----------------------------------------------------------------------------------
_PROCESS = os.urandom(6).hex()  # ids: a random per-process prefix and a counter (no urandom per request)
_COUNTER = itertools.count()
_SEEDS = random.Random(os.urandom(16))


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{_PROCESS}{next(_COUNTER):08x}"


def random_seed() -> int:
    """A seed for a request that gave none (reported back, so the output can be reproduced)."""
    return _SEEDS.getrandbits(63)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(request: ServeRequest, rid: str, model: str, text: str, finish_reason: str, usage_: dict,
             extras: dict) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion."""
    if request.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion" if request.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage_, "dspark": extras}


def chunk(request: ServeRequest, rid: str, model: str, created: int, *, text: str | None = None,
          role: bool = False, finish_reason: str | None = None, extras: dict | None = None,
          usage_: dict | None = None) -> dict[str, Any]:
    """One stream chunk; with usage_ it is the final usage chunk (no choices)."""
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if request.chat else "text_completion",
                           "created": created, "model": model}
    if usage_ is not None:
        out.update(choices=[], usage=usage_)
        return out
    if request.chat:
        delta: dict[str, str] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        out["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    if extras is not None:
        out["dspark"] = extras
    return out


class TokenChunks:
    """The stream's token chunks (one per step per client: the hot path) with their constant parts rendered
    once; the bytes equal `sse(chunk(..., text=text, extras={"token_ids": ids}))`."""

    def __init__(self, request: ServeRequest, rid: str, model: str, created: int) -> None:
        head = json.dumps({"id": rid, "object": "chat.completion.chunk" if request.chat else "text_completion",
                           "created": created, "model": model}, separators=(",", ":"), ensure_ascii=False)[:-1]
        field = '"delta":{"content":' if request.chat else '"text":'
        self._pre = f'data: {head},"choices":[{{"index":0,{field}'
        self._post = ('}' if request.chat else '') + ',"logprobs":null,"finish_reason":null}],"dspark":{"token_ids":['

    def render(self, text: str, ids: list[int]) -> bytes:
        body = json.dumps(text, ensure_ascii=False)
        return f"{self._pre}{body}{self._post}{','.join(map(str, ids))}]}}}}\n\n".encode()


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
