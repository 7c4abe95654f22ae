"""The demo corpus: the running interpreter's own standard-library source, plus its tokenizer.

Training uses every `*.py` file under `sysconfig.get_paths()["stdlib"]` in sorted order, minus
the test suites and generated data tables, minus the fixed held-out modules below, which are
kept for evaluation. The bundled demo pair was trained on CPython 3.11.7's `Lib/`.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)  # ids 0 and 1

# Evaluation-only modules (paths relative to the stdlib root); never seen in training.
HELD_OUT_MODULES = (
    "argparse.py",
    "bisect.py",
    "csv.py",
    "difflib.py",
    "fractions.py",
    "gzip.py",
    "heapq.py",
    "ipaddress.py",
    "json/decoder.py",
    "queue.py",
    "shlex.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
    "uuid.py",
)
# Test suites, IDLE, demos and generated tables: not the library code we want to imitate.
_EXCLUDED_DIRS = {"test", "tests", "idlelib", "turtledemo", "pydoc_data", "encodings", "site-packages"}


class CorpusError(RuntimeError):
    """The standard-library source cannot be found or is incomplete."""


def stdlib_root() -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not (root / "os.py").is_file():
        raise CorpusError(f"no Python source under {root}: this interpreter ships without its Lib/ .py files")
    return root


def corpus_files(split: str, root: Path | None = None) -> list[Path]:
    """Sorted source files of `split`: "train" (everything kept) or "heldout"."""
    root = root or stdlib_root()
    if split == "heldout":
        missing = [m for m in HELD_OUT_MODULES if not (root / m).is_file()]
        if missing:
            raise CorpusError(f"held-out modules missing under {root}: {missing}")
        return [root / m for m in HELD_OUT_MODULES]
    if split != "train":
        raise ValueError(f"unknown corpus split {split!r} (expected 'train' or 'heldout')")
    held_out = set(HELD_OUT_MODULES)
    return [
        path
        for path in sorted(root.rglob("*.py"))
        if not _EXCLUDED_DIRS & set(path.relative_to(root).parts[:-1])
        and path.relative_to(root).as_posix() not in held_out
    ]


def read_documents(paths: Sequence[Path]) -> list[str]:
    return [path.read_text(encoding="utf-8", errors="replace") for path in paths]


def train_tokenizer(documents: Sequence[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE; the special tokens take ids 0 (eos) and 1 (the drafter's mask)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def special_token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise CorpusError(f"tokenizer has no {token!r} token: train it with `dspark train tokenizer`")
    return token_id


def encode_corpus(tokenizer: Tokenizer, documents: Sequence[str]) -> torch.Tensor:
    """One flat token stream [N] int64: every document followed by eos."""
    eos = special_token_id(tokenizer, EOS_TOKEN)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(documents)):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def sample_windows(
    stream: torch.Tensor,  # [N] int64
    *,
    batch: int,
    length: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """[batch, length] windows at uniform random offsets of the stream."""
    if stream.numel() <= length:
        raise CorpusError(f"corpus has {stream.numel()} tokens, fewer than one window of {length + 1}")
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])
