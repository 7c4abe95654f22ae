"""Reading the files dspark writes or ships (export.json, engine.json, graphs, plans, tokenizer.json):
one error type that names the file and what is wrong with it, so every command can print it as one line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


class ArtifactError(ValueError):
    """An export or engine file is missing, unreadable, truncated, or does not follow its schema.
    The message starts with the file's path and ends with what to do about it."""

    def __init__(self, path: str | Path, problem: str, fix: str = "") -> None:
        self.path = Path(path)
        super().__init__(f"{path}: {problem}" + (f"; {fix}" if fix else ""))


def first_line(exc: BaseException) -> str:
    """A foreign library's error as a short reason (its first line, or its type), for a one-line message."""
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_json_object(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in `path`; ArtifactError when the file is missing, not UTF-8 JSON, or not an object."""
    if not path.is_file():
        raise ArtifactError(path, "is missing", fix)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(path, f"is not valid JSON ({exc})", fix) from None
    if not isinstance(value, dict):
        raise ArtifactError(path, f"holds a JSON {type(value).__name__}, not an object", fix)
    return value


def check_size(path: Path, expected_bytes: int, fix: str) -> None:
    """A cheap check at load (no hashing): the file exists and has the size its manifest records,
    which catches truncated and half-copied files; `verify` in the readers also checks sha256."""
    if not path.is_file():
        raise ArtifactError(path, "is missing", fix)
    size = path.stat().st_size
    if size != expected_bytes:
        raise ArtifactError(path, f"is {size} bytes but its manifest records {expected_bytes} (truncated or "
                                  f"replaced)", fix)


def check_sha256(path: Path, expected: str, fix: str) -> None:
    if not path.is_file():
        raise ArtifactError(path, "is missing", fix)
    if sha256(path) != expected:
        raise ArtifactError(path, "does not match the sha256 its manifest records (modified or truncated)", fix)


def read_tokenizer(path: Path, fix: str) -> Any:
    """The `tokenizers.Tokenizer` in tokenizer.json; ArtifactError when the file is missing or unreadable
    (tokenizers itself raises a bare Exception that does not name the file)."""
    if not path.is_file():
        raise ArtifactError(path, "is missing", fix)
    from tokenizers import Tokenizer  # only commands given text need it

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ArtifactError(path, f"is not a readable tokenizer.json ({first_line(exc)})", fix) from None
