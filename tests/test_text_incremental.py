"""Streamed text decoded incrementally (runtime/text.py): the same text, cuts and deltas as decoding the
whole output after every step, for a fraction of the work.

The oracles below are the full-decode algorithms the incremental ones replaced."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dspark.runtime.text import IncrementalText, StopWatch, TextCodec, TextStream, cut_text

DEMO_TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "demo" / "target"
FFFD = "\ufffd"


class CountingCodec:
    """A codec that counts the tokens it decodes."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec, self.decoded = codec, 0
        self.skipped_ids = codec.skipped_ids

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.codec.decode(ids)


def metaspace_codec(tmp: Path) -> TextCodec:
    """A SentencePiece-style tokenizer (Metaspace: the decoder drops a sequence's leading space)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    text = ["def parse(value, default=None):", "    return value or default", "résumé → naïve café", "x = 1\n\ny = 2"]
    tok.train_from_iterator(text * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    tok.save(str(tmp / "tokenizer.json"))
    return TextCodec.from_dir(tmp)


@pytest.fixture(scope="module", params=["demo-bytelevel", "metaspace"])
def codec(request, tmp_path_factory) -> TextCodec:
    if request.param == "metaspace":
        return metaspace_codec(tmp_path_factory.mktemp("metaspace"))
    return TextCodec.from_dir(DEMO_TOKENIZER)


def random_outputs(codec: TextCodec, count: int, seed: int) -> list[list[int]]:
    """Token sequences a model could emit: encoded text (multi-byte characters, blank lines) and random ids
    (byte tokens that split characters, special tokens)."""
    rng = random.Random(seed)
    vocab = codec.vocab_size
    phrases = ["def f(x):\n", "    return x\n\n", "é", "←", "naïve ", "done", " café", "\n", "🙂"]
    outputs = []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < rng.randint(5, 60):
            if rng.random() < 0.6:
                ids += codec.encode(rng.choice(phrases), add_special_tokens=False)
            else:
                ids.append(rng.randrange(vocab))
        outputs.append(ids)
    return outputs


def chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 8)  # a step commits 1..γ+1 tokens
        out.append(ids[i : i + n])
        i += n
    return out


def oracle_stream(codec: TextCodec, stops: tuple[str, ...], pushes: list[list[int]]) -> list[str]:
    """The old TextStream: decode everything after every push."""
    tokens, sent, pieces = [], "", []
    for new in pushes:
        tokens += new
        text = cut_text(codec.decode(tokens), stops)
        safe = len(text.rstrip(FFFD))
        tail = 0
        for s in stops:
            for n in range(min(len(s) - 1, safe), tail, -1):
                if text[:safe].endswith(s[:n]):
                    tail = n
                    break
        safe -= tail
        piece = text[len(sent) : safe] if safe > len(sent) else ""
        sent += piece
        pieces.append(piece)
    return pieces


def oracle_cut(codec: TextCodec, stops: tuple[str, ...], ids: list[int]) -> int | None:
    return next((k for k in range(1, len(ids) + 1) if any(s in codec.decode(ids[:k]) for s in stops)), None)


def test_incremental_text_equals_a_full_decode_after_every_push(codec):
    rng = random.Random(0)
    for ids in random_outputs(codec, 60, seed=1):
        decoded, seen = IncrementalText(codec), []
        for new in chunks(ids, rng):
            decoded.extend(new)
            seen.append(new)
            assert decoded.text == codec.decode(decoded.tokens).rstrip(FFFD)


def test_text_stream_sends_what_a_full_decode_sends(codec):
    rng = random.Random(2)
    for ids in random_outputs(codec, 60, seed=3):
        full = codec.decode(ids)
        stops = tuple({"\n\n", rng.choice(["done", "é", "x"]), full[5:9] or "zz"} - {""})
        pushes = chunks(ids, rng)
        stream = TextStream(codec, stops)
        assert [stream.push(p) for p in pushes] == oracle_stream(codec, stops, pushes)


def test_stop_watch_cuts_at_the_token_a_full_decode_finds(codec):
    rng = random.Random(4)
    found = 0
    for ids in random_outputs(codec, 60, seed=5):
        full = codec.decode(ids)
        start = rng.randrange(max(1, len(full) - 3))
        stops = (full[start : start + rng.randint(1, 3)] or "\n\n", "\n\n")
        watch, tokens, cut = StopWatch(codec, stops), [], None
        for new in chunks(ids, rng):
            tokens += new
            cut = watch.check(tokens)
            if cut is not None:
                break
        assert cut == oracle_cut(codec, stops, ids)
        assert watch.check(tokens) == cut  # asked again: the same token
        found += cut is not None
    assert found > 30  # the stops chosen above are mostly in the text


def test_streaming_a_long_output_decodes_each_token_a_few_times():
    """Work grows with the output, not with its square: 2000 tokens pushed one step at a time decode under
    ten tokens per token (a full decode per step would decode about a million)."""
    codec = TextCodec.from_dir(DEMO_TOKENIZER)
    ids = codec.encode("    for key, value in items.items():\n        total += value  # é ←\n" * 100,
                       add_special_tokens=False)[:2000]
    assert len(ids) == 2000
    counting = CountingCodec(codec)
    stream, watch, tokens = TextStream(counting, ("\n\n\n",)), StopWatch(counting, ("\n\n\n",)), []
    pieces = []
    for i in range(0, len(ids), 2):
        tokens += ids[i : i + 2]
        pieces.append(stream.push(ids[i : i + 2]))
        assert watch.check(tokens) is None
    assert "".join(pieces) + stream.finish(codec.decode(ids)) == codec.decode(ids)
    assert counting.decoded < 10 * len(ids)
