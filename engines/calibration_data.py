"""Calibration data: held-out sequences in, (confidence logits, accepted drafts) per draft round out.

Data file formats (one sequence per line):
    *.jsonl   {"ids": [1, 2, 3]} or {"text": "..."} (text needs a tokenizer.json), or a bare [1, 2, 3]
    other     "1 2 3" / "1,2,3" token ids, or plain text (needs a tokenizer.json)

Each sequence's first `prompt_len` tokens become a prompt; the engine's own graphs (ONNX Runtime,
through the runtime's batch loop) decode it greedily with every block fully verified (fixed
scheduler, γ drafts per round), and every round contributes one row: the γ pre-sigmoid
confidence logits of its block and the number of drafts the target accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dspark.export.artifacts import read_tokenizer
from dspark.runtime.backend import Backend
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig

from .export_source import BuildError

_ID_SEPARATORS = re.compile(r"[,\s]+")


def _is_id_line(line: str) -> bool:
    # A split instead of one regex over the line: a nested-quantifier pattern backtracks
    # exponentially on long text lines full of numbers (code, tables).
    return all(token.isdecimal() for token in _ID_SEPARATORS.split(line.strip()))


def read_sequences(path: str | Path, tokenizer: str | Path | None = None) -> list[list[int]]:
    """Token id sequences from a calibration data file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise BuildError(f"calibration data {path} does not exist")
    encode = None
    sequences = []
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    for number, line in enumerate(lines, 1):
        item: object = line
        if path.suffix == ".jsonl":
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                raise BuildError(f"{path}:{number}: not valid JSON") from None
            if isinstance(item, dict):
                item = item.get("ids", item.get("text"))
        if isinstance(item, list) and all(isinstance(t, int) for t in item):
            sequences.append(item)
        elif isinstance(item, str) and _is_id_line(item):
            sequences.append([int(t) for t in _ID_SEPARATORS.split(item.strip())])
        elif isinstance(item, str):
            if encode is None:
                encode = _tokenizer(path, tokenizer)
            sequences.append(encode(item))
        else:
            raise BuildError(f'{path}:{number}: expected {{"ids": [...]}}, {{"text": "..."}} or a list of ids')
    if not sequences:
        raise BuildError(f"calibration data {path} holds no sequences")
    return sequences


def _tokenizer(data: Path, tokenizer: str | Path | None):
    if tokenizer is None or not Path(tokenizer).is_file():
        raise BuildError(f"{data} holds text: a tokenizer.json is needed (none at {tokenizer}); "
                         f"pass --tokenizer FILE or give token ids")
    tok = read_tokenizer(Path(tokenizer), "pass --tokenizer with a tokenizers-format tokenizer.json")
    return lambda text: tok.encode(text).ids


def collect_rounds(
    backend: Backend,
    info: ModelInfo,
    sequences: Sequence[Sequence[int]],
    *,
    prompt_len: int = 32,
    max_new_tokens: int = 64,
    max_requests: int = 8,
) -> tuple[np.ndarray, np.ndarray]:
    """-> confidence logits [N, γ] (pre-sigmoid) and accepted drafts [N] over all draft rounds."""
    if not info.has_confidence:
        raise BuildError("the drafter has no confidence head: there is nothing to calibrate")
    vocab = info.vocab_size
    prompts = [list(s[:prompt_len]) for s in sequences if s]
    bad = [t for p in prompts for t in p if not 0 <= t < vocab]
    if bad:
        raise BuildError(f"calibration data has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    seq_len = prompt_len + max_new_tokens + info.block_size + 1
    engine = BatchEngine(backend, info, capacity=Capacity(max_requests, max_requests * seq_len, seq_len),
                              scheduler=SchedulerConfig("fixed"), kv_mode="concat")
    for prompt in prompts:
        engine.submit(prompt, max_new_tokens=max_new_tokens)
    confidences, accepted = [], []
    while not engine.idle:
        record = engine.step()
        if record is None or record.confidence_logits is None:
            continue
        confidences.append(np.asarray(record.confidence_logits, dtype=np.float64))
        accepted.append(np.asarray(record.acceptance_lengths) - 1)  # the bonus token is not a draft
    if not confidences:
        raise BuildError("calibration produced no draft rounds (prompts too short or max_new_tokens too small)")
    return np.concatenate(confidences), np.concatenate(accepted)
