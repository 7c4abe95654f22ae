"""tools/prefill_bench: both ways run on a fused export and report the logits each makes."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from conftest import golden_path

from dspark.export.pipeline import export_pair
from dspark.tools.prefill_bench import main, measure

SET = "qwen3-tiny-vanilla"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    export_pair(golden_path(SET, "target"), golden_path(SET, "drafter"), out, check=False)
    return out


def test_prefill_logits_everywhere_and_at_the_last_position(exported):
    full, last = (measure(exported, 40, 1, last_only=way) for way in (False, True))
    assert full["logits"][:2] == (1, 40) and last["logits"][:2] == (1, 1) and full["logits"][2] == last["logits"][2]


def test_the_command_prints_both_ways_and_refuses_an_export_without_logits_rows(exported, tmp_path):
    done = CliRunner().invoke(main, ["--export", str(exported), "--tokens", "24", "--repeats", "1"])
    assert done.exit_code == 0, done.output
    assert "every position: logits [1, 24," in done.output and "the last only : logits [1, 1," in done.output
    plain = tmp_path / "plain"
    export_pair(golden_path(SET, "target"), golden_path(SET, "drafter"), plain, check=False, flavours=("plain",))
    refused = CliRunner().invoke(main, ["--export", str(plain), "--tokens", "24", "--only", "last"])
    assert refused.exit_code != 0 and "no fused target with logits_rows" in refused.output
