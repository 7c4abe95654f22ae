"""The bundled demo pair (models/demo) loads, fits the size budget and decodes losslessly."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from dspark.models import load_pair
from dspark.runtime.reference_decoder import autoregressive_generate, speculative_generate
from dspark.tools import corpus

DEMO = Path(str(resources.files("dspark.models") / "demo"))
SHIPPED = ("config.json", "model.safetensors")


def test_demo_folders_are_complete_and_small() -> None:
    for name in ("target", "dspark", "dflash"):
        for file in SHIPPED:
            assert (DEMO / name / file).is_file(), f"{DEMO / name / file} is missing"
    for file in ("tokenizer.json", "generation_config.json"):
        assert (DEMO / "target" / file).is_file()
    total = sum(p.stat().st_size for p in DEMO.rglob("*") if p.is_file())
    assert total <= 50 * 2**20, f"models/demo holds {total / 2**20:.1f} MiB, over the 50 MiB budget"


def test_demo_special_tokens_agree_with_configs() -> None:
    tokenizer = Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json"))
    target = json.loads((DEMO / "target" / "config.json").read_text())
    assert target["eos_token_id"] == tokenizer.token_to_id(corpus.EOS_TOKEN)
    for name in ("dspark", "dflash"):
        drafter = json.loads((DEMO / name / "config.json").read_text())
        assert drafter["mask_token_id"] == tokenizer.token_to_id(corpus.MASK_TOKEN)
        assert drafter["block_size"] == 7


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_demo_greedy_speculative_equals_target_greedy(name: str) -> None:
    target, drafter = load_pair(DEMO / "target", DEMO / name)
    tokenizer = Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json"))
    source = (corpus.stdlib_root() / "textwrap.py").read_text(encoding="utf-8")  # a held-out module
    prompt = tokenizer.encode(source).ids[200:248]
    expected = autoregressive_generate(target, prompt, max_new_tokens=24)
    result = speculative_generate(target, drafter, prompt, max_new_tokens=24)
    assert result.tokens[:24] == expected
    assert sum(r.acceptance_length for r in result.rounds) / len(result.rounds) > 1.0
