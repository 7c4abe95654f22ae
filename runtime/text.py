"""Text in and out of the runtime: the export's tokenizer.json, tokenizer_config.json's chat template,
stop strings and streamed text.

The decode loop only knows token ids; this is the one place that turns text into ids and ids back into
text, so `Runtime.generate` and the HTTP server cut at a stop string at the same token and stream the
same text. Chat templates are Jinja, rendered in jinja2's sandbox (jinja2 comes with torch); nothing
here imports transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from dspark.export.artifacts import ArtifactError, read_json_object, read_tokenizer

from .requests import RequestError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
_FIX = "re-export the pair with its tokenizer.json, or give token ids instead of text"
MESSAGE_KEYS = ("role", "content", "name")


class NoTokenizerError(ArtifactError, RequestError):
    """Text given to a model whose directories hold no tokenizer.json: a missing artifact, and a request
    that can be fixed by sending token ids."""


class TextCodec:
    """A `tokenizers.Tokenizer` plus the chat template and special tokens of tokenizer_config.json."""

    def __init__(self, tokenizer: Any, *, source: Path, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        self.tokenizer, self.source = tokenizer, source
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self._template = None if chat_template is None else _compile(chat_template, source.parent / CONFIG_FILE)
        self._skipped: frozenset[int] | None = None

    @classmethod
    def from_dir(cls, folder: str | Path) -> TextCodec:
        """folder/tokenizer.json (+ tokenizer_config.json when present); ArtifactError naming the bad file."""
        folder = Path(folder)
        tokenizer = read_tokenizer(folder / TOKENIZER_FILE, _FIX)
        template, special = None, {}
        config_path = folder / CONFIG_FILE
        if config_path.is_file():
            config = read_json_object(config_path, "fix or delete it (it is optional)")
            template = _template_text(config.get("chat_template"), config_path)
            special = {key: text for key, value in config.items()
                       if key.endswith("_token") and (text := _token_text(value)) is not None}
        return cls(tokenizer, source=folder / TOKENIZER_FILE, chat_template=template, special_tokens=special)

    @classmethod
    def find(cls, folders: Sequence[Path]) -> TextCodec:
        """The codec of the first folder holding a tokenizer.json; ArtifactError naming where it was looked for."""
        for folder in folders:
            if (Path(folder) / TOKENIZER_FILE).is_file():
                return cls.from_dir(folder)
        where = Path(folders[0]) / TOKENIZER_FILE if folders else Path(TOKENIZER_FILE)
        raise NoTokenizerError(where, "is missing, and text needs it",
                               "prompts must be a sequence of token ids without it (or re-export the pair with it)")

    @property
    def skipped_ids(self) -> frozenset[int]:
        """The ids `decode` leaves out: special tokens."""
        if self._skipped is None:
            added = self.tokenizer.get_added_tokens_decoder()
            self._skipped = frozenset(i for i, token in added.items() if token.special)
        return self._skipped

    @property
    def vocab_size(self) -> int:
        """One more than the largest id the tokenizer can produce."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: object, *, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids; RequestError for anything that is not encodable text."""
        if not isinstance(text, str):
            raise RequestError(f"text prompt must be a string, got {type(text).__name__}")
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        except Exception as exc:  # e.g. lone surrogates
            raise RequestError(f"text cannot be tokenized: {str(exc)[:200]}") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, special tokens (eos, mask) left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: object, *, add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation; RequestError without a template or for bad messages."""
        if self._template is None:
            raise RequestError(f"this model has no chat template (no 'chat_template' in {CONFIG_FILE} beside "
                               f"{self.source}); use completions with a text prompt")
        checked = chat_messages(messages)
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=checked, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise RequestError(f"the chat template refused these messages: {str(exc)[:200]}") from None

    def encode_chat(self, messages: object) -> list[int]:
        """Conversation -> prompt ids (the template writes its own special tokens)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def chat_messages(messages: object) -> list[dict[str, str]]:
    """OpenAI chat messages as [{"role", "content"(, "name")}] with text content; RequestError naming the field."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with role and content")
        for key in message:
            if key not in MESSAGE_KEYS:
                raise RequestError(f"{where}.{key} is not supported")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise RequestError(f"{where}.role must be a non-empty string")
        checked = {"role": role, "content": _content_text(content, f"{where}.content")}
        if "name" in message:
            if not isinstance(message["name"], str):
                raise RequestError(f"{where}.name must be a string")
            checked["name"] = message["name"]
        out.append(checked)
    return out


def _content_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}[{j}] must be {{\"type\": \"text\", \"text\": string}} (text only)")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where} must be a string or a list of text parts")


def _template_text(value: object, path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or HF's list of named templates ("default")."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        if isinstance(template, str):
            return template
    raise ArtifactError(path, "'chat_template' must be a string or a list with a 'default' template",
                        "fix or remove it")


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]  # HF AddedToken form
    return None


def _compile(text: str, path: Path) -> Any:
    """The template compiled in jinja2's immutable sandbox, with the helpers HF templates call."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                  ensure_ascii=ensure_ascii)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(text)
    except jinja2.TemplateError as exc:
        raise ArtifactError(path, f"'chat_template' is not a valid Jinja template ({str(exc)[:200]})",
                            "fix or remove it") from None


def check_stop_strings(stops: Sequence[str]) -> tuple[str, ...]:
    """Non-empty strings, as a tuple."""
    for s in stops:
        if not isinstance(s, str) or not s:
            raise RequestError(f"stop strings must be non-empty strings, got {s!r:.40}")
    return tuple(stops)


def cut_text(text: str, stops: Sequence[str]) -> str:
    """`text` up to (not including) the earliest stop string in it."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(hits)] if hits else text


class IncrementalText:
    """decode(tokens) kept up to date as tokens are appended, for the price of the newest few tokens per call
    rather than the whole output (a full decode per step is quadratic in the output length). The window
    trick of streaming detokenizers: decode a short window of recent tokens with and without the new ones
    and append the difference, so a decoder that treats a sequence's first token specially (a Metaspace
    leading space) sees the same start both times; the window keeps at least one token that decode does
    not skip before the new ones, or that first token would be a different one each time. A window ending
    in a partial UTF-8 character (U+FFFD) stays open until the tokens that complete it arrive; `text` leaves
    that character out."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.tokens: list[int] = []
        self.text = ""  # decode(tokens) without its trailing U+FFFD
        self._settled = ""  # decode(tokens[:_read])
        self._start = 0  # the window: tokens[_start:], of which tokens[_start:_read] are in _settled
        self._read = 0

    def extend(self, new_tokens: Sequence[int]) -> None:
        self.tokens.extend(new_tokens)
        window = self.codec.decode(self.tokens[self._start :])
        base = self.codec.decode(self.tokens[self._start : self._read]) if self._read > self._start else ""
        if not window.startswith(base):  # the new tokens changed settled text: start again from the whole
            self._settled, self._start, self._read, base = "", 0, 0, ""
            window = self.codec.decode(self.tokens)
        if window.endswith("\ufffd"):
            self.text = self._settled + window[len(base) :].rstrip("\ufffd")
            return
        self._settled += window[len(base) :]
        self.text = self._settled
        skipped = self.codec.skipped_ids
        if any(t not in skipped for t in self.tokens[self._read :]):
            self._start = self._read
        self._read = len(self.tokens)


class StopWatch:
    """Finds the token at which a stop string first appears in the decoded output, decoding only what was
    added since the last call. Both `Runtime.generate` and the server call it after every step and cut
    there, so both end a request at the same token."""

    def __init__(self, codec: TextCodec, stops: Sequence[str]) -> None:
        self.codec, self.stops = codec, tuple(stops)
        self.decoded = IncrementalText(codec)
        self._longest = max(map(len, self.stops), default=0)
        self._cut: int | None = None

    def check(self, tokens: Sequence[int]) -> int | None:
        """The shortest length k with a stop string in decode(tokens[:k]), or None. `tokens` is the whole
        output so far (it only grows between calls)."""
        if self._cut is not None or not self.stops or len(tokens) <= len(self.decoded.tokens):
            return self._cut
        checked, searched = len(self.decoded.tokens), len(self.decoded.text)
        self.decoded.extend(tokens[checked:])
        tail = self.decoded.text[max(0, searched - self._longest + 1) :]
        if any(s in tail for s in self.stops):  # rare: find the token by bisection, once per request
            lo, hi = checked, len(tokens)  # no stop in decode(tokens[:lo]), one in decode(tokens[:hi])
            while hi - lo > 1:
                mid = (lo + hi) // 2
                text = self.codec.decode(tokens[:mid])
                lo, hi = (lo, mid) if any(s in text for s in self.stops) else (mid, hi)
            self._cut = hi
        return self._cut


class TextStream:
    """Text deltas of a growing output whose concatenation is the final text: a trailing partial UTF-8
    character and a tail that could begin a stop string are held back until the next tokens settle them."""

    def __init__(self, codec: TextCodec, stops: Sequence[str] = ()) -> None:
        self.stops = tuple(stops)
        self.decoded = IncrementalText(codec)
        self._longest = max(map(len, self.stops), default=0)
        self.sent = 0  # characters handed out

    def push(self, new_tokens: Sequence[int]) -> str:
        """The text that became final with `new_tokens` ("" when it is all held back)."""
        self.decoded.extend(new_tokens)
        text = self.decoded.text
        # Sent text holds no whole stop string, so the earliest one starts in the last _longest - 1 sent
        # characters or later.
        lo = max(0, self.sent - self._longest + 1)
        hits = [i for i in (text.find(s, lo) for s in self.stops) if i >= 0]
        end = min(hits) if hits else len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        end -= _stop_prefix_tail(text[max(0, end - self._longest) : end], self.stops)
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent : end], end
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the final text after what was sent."""
        delta = final_text[self.sent :]
        self.sent += len(delta)
        return delta


def _stop_prefix_tail(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
