"""The bench's engines of the demo pair are STS-calibrated, on prompts apart from the bench's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import golden_path

from dspark.tools.bench import subjects

DEMO_TOKENIZER = subjects.DEMO_DIR / "target" / "tokenizer.json"


def _shared_8grams(windows: list[list[int]], prompts: list[list[int]]) -> int:
    grams = {tuple(p[i : i + 8]) for p in prompts for i in range(len(p) - 7)}
    return sum(any(tuple(w[i : i + 8]) in grams for i in range(len(w) - 7)) for w in windows)


@pytest.mark.skipif(not DEMO_TOKENIZER.is_file(), reason="the bundled demo pair is not installed")
def test_calibration_prompts_lie_apart_from_the_benchs_prompts():
    windows = subjects.demo_calibration(DEMO_TOKENIZER)
    assert len(windows) >= 64 and {len(w) for w in windows} == {subjects.CALIBRATION_PROMPT_LEN}
    # the bench's single-stream prompts (8 x 64 tokens) and its sweep's (64 x 32), and a sweep up to 16 requests
    for count, length in ((8, 64), (64, 32), (16, 32)):
        prompts, source = subjects.load_prompts(None, DEMO_TOKENIZER, count=count, length=length, vocab_size=4096,
                                                avoid=(0, 1))
        assert source == "held-out standard-library modules"
        assert _shared_8grams(windows, prompts) == 0, (count, length)


def test_a_calibrated_cached_engine_has_its_own_folder_and_says_so(tmp_path: Path):
    pair = golden_path("qwen3-tiny-vanilla")
    prompts = [[(7 * i + k) % 200 + 2 for k in range(12)] for i in range(8)]
    raw = subjects.cached_engine_dir(pair / "target", pair / "drafter", tmp_path)
    calibrated = subjects.cached_engine_dir(pair / "target", pair / "drafter", tmp_path, calibration=prompts)
    assert raw.parent != calibrated.parent and calibrated.parent.name.endswith("-sts")
    assert json.loads((raw / "engine.json").read_text())["calibration"] is None
    assert subjects.confidence_note(raw) == "raw confidences (not STS-calibrated)"
    record = json.loads((calibrated / "engine.json").read_text())["calibration"]
    assert record["sequences"] == len(prompts) and len(record["temperatures"]) == 7
    assert subjects.confidence_note(calibrated).startswith(f"confidences STS-calibrated on {len(prompts)} prompts")
    written = [json.loads(line)["ids"] for line in (calibrated.parent / "calibration.jsonl").read_text().splitlines()]
    assert written == prompts
