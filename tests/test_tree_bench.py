"""tools/tree_bench runs end to end on the golden pair and writes its JSON and PNG."""

from __future__ import annotations

import json

from click.testing import CliRunner
from conftest import golden_path

from dspark.tools.tree_bench import main, sps_from_rounds


def test_tree_bench_writes_json_and_png(tmp_path) -> None:
    folder = golden_path("qwen3-tiny-vanilla")
    result = CliRunner().invoke(main, [
        "--target", str(folder / "target"), "--drafter", str(folder / "drafter"), "--out", str(tmp_path),
        "--prompts", "1", "--calibration-prompts", "1", "--new-tokens", "12", "--budgets", "2,8",
        "--temperatures", "0,1",
    ])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "tree_bench.json").read_text())
    assert (tmp_path / "tree_bench.png").stat().st_size > 0
    for key in ("T=0", "T=1"):
        row = data[key]
        for method in ("chain/2", "chain/8", "markov/2", "markov/8", "marginals/8", "markov+sched"):
            budget = 8 if method == "markov+sched" else int(method.split("/")[1])
            m = row[method]
            assert m["tokens"] == 12, method
            # one prompt: 1 prefill token + Σ acceptance lengths ≥ 12, and the last round began below 12,
            # so 11 ≤ Σ = rounds·τ < 11 + (its acceptance length ≤ budget + 1); τ is rounded to 3 places
            total, slack = m["rounds"] * m["mean_acceptance_length"], m["rounds"] * 5e-4
            assert 11 - slack <= total < 11 + budget + 1 + slack, (key, method, m)
            assert 1.0 <= m["mean_acceptance_length"] <= budget + 1, (key, method)
        # the trained pair's drafts are accepted, not only the bonus
        assert row["chain/8"]["mean_acceptance_length"] > 1.0 and row["markov/8"]["mean_acceptance_length"] > 1.0
        assert row["markov/8"]["mean_draft_nodes"] <= 8 and row["chain/2"]["mean_draft_nodes"] == 2
    no_drafts = data["T=0"]["markov/0"]  # 0 nodes: every round commits only its bonus
    assert (no_drafts["rounds"], no_drafts["mean_acceptance_length"]) == (11, 1.0)
    assert data["T=1"]["sampled-markov/8"]["tokens"] == 12 and "sampled-markov/8" not in data["T=0"]
    assert set(data["cost_table_cpu_seconds_per_round"]) == {"1", "3", "9"}
    assert set(data["calibration"]) == {"T=0/best_first", "T=1/best_first", "T=1/sampled"}
    assert data["T=1"]["markov+sched"]["draw"] == "sampled"


def test_sps_interpolates_and_extrapolates_round_times() -> None:
    sps = sps_from_rounds({0: 1.0, 8: 2.0})  # B = 1 -> 1 s, B = 9 -> 2 s
    assert sps(5) == 1.0 / 1.5 and sps(17) == 1.0 / 3.0
