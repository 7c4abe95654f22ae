"""The text side of a model pair, apart from its sessions: the tokenizer (read on first use from the pair's
text folders), encode / decode / chat, and the prompt and stop rules every front end applies. `Runtime` has it
over its own engine; `ModelText` alone is what a front end holds when the engine runs in another process
(runtime/serving/process_service.py) or on other machines (runtime/cluster/fleet.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspark.export.artifacts import ArtifactError

from .model_info import ModelInfo
from .requests import RequestError, as_list, token_ids
from .text import TextCodec, check_stop_strings

Prompt = Sequence[int]
Stop = Sequence[int | str] | str  # token ids and/or stop strings


class TextMethods:
    """Mixin: text over `self.info` and `self.text_dirs` (the owner sets `self._codec = None`)."""

    info: ModelInfo
    text_dirs: tuple[Path, ...]
    _codec: TextCodec | None

    @property
    def tokenizer(self) -> TextCodec:
        """The pair's tokenizer (read on first use); ArtifactError naming tokenizer.json when it is
        missing, unreadable or larger than the model's vocabulary."""
        if self._codec is None:
            codec = TextCodec.find(self.text_dirs)
            if codec.vocab_size > self.info.vocab_size:
                raise ArtifactError(codec.source, f"has {codec.vocab_size} tokens but the model's vocabulary has "
                                                  f"{self.info.vocab_size}", "use the target's own tokenizer.json")
            self._codec = codec
        return self._codec

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def chat_prompt(self, messages: object) -> list[int]:
        """OpenAI-style messages -> prompt ids through the chat template; RequestError without one."""
        return self.tokenizer.encode_chat(messages)

    def prompt_ids(self, prompt: str | Prompt) -> list[int]:
        """A text prompt encoded, or token ids as given."""
        return self.encode(prompt) if isinstance(prompt, str) else prompt

    def split_stop(self, stop: Stop) -> tuple[list[int], tuple[str, ...]]:
        """`stop` as (token ids, stop strings); a lone string is one stop string."""
        items = [stop] if isinstance(stop, str) else as_list(stop)
        if not isinstance(items, Sequence):
            raise RequestError(f"stop must be a sequence of token ids and/or strings, got {type(stop).__name__}")
        strings = check_stop_strings([s for s in items if isinstance(s, str)])
        if strings:
            self.tokenizer  # noqa: B018 - stop strings need the tokenizer: fail now, before any work
        return token_ids([s for s in items if not isinstance(s, str)], "stop"), strings


class ModelText(TextMethods):
    """A pair's model info and text without its sessions. `options`: what the engine runs with (the app and
    the metrics read its scheduler's STS temperatures), when known."""

    def __init__(self, info: ModelInfo, text_dirs: Sequence[str | Path], options: Any = None) -> None:
        self.info, self.text_dirs, self.options = info, tuple(Path(d) for d in text_dirs), options
        self._codec = None
