"""`dspark bench` end to end on the golden tiny models, and its greedy-equality check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import golden_path

from dspark.tools.bench import peers, single_stream, subjects
from dspark.tools.bench.plots import PLOTS
from dspark.tools.bench.timeline import System, Timeline
from dspark.tools.bench_command import bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory) -> Path:
    """One tiny bench run (peers included when installed) shared by the tests below."""
    out = tmp_path_factory.mktemp("bench")
    vanilla = golden_path("qwen3-tiny-vanilla")
    args = ["--out", str(out), "--quick", "--target", str(vanilla / "target"), "--drafter", str(vanilla / "drafter"),
            "--dflash", str(golden_path("dflash-tiny", "drafter")), "--num-prompts", "2", "--prompt-len", "12",
            "--new-tokens", "16", "--concurrency", "1,3", "--sweep-new-tokens", "6"]
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def test_results_schema_and_plots(bench_out: Path) -> None:
    results = json.loads((bench_out / "results.json").read_text())
    assert results["schema_version"] == 1
    assert set(results["acceptance"]) == {"DSpark", "DSpark, Markov head off", "DFlash"}
    for name, a in results["acceptance"].items():
        assert a["status"] == "ok", name
        assert len(a["conditional_acceptance"]) == a["block_size"] == 7
        assert all(p is None or 0.0 <= p <= 1.0 for p in a["conditional_acceptance"])
        assert a["position_samples"][0] == a["rounds"] >= a["position_samples"][-1]
        # drafts accepted at position k = rounds that reached k × the rate there = rounds that reach k + 1
        accepted = [0.0 if p is None else p * n
                    for p, n in zip(a["conditional_acceptance"], a["position_samples"], strict=True)]
        assert accepted[:-1] == pytest.approx(a["position_samples"][1:], abs=1e-9), name
        # τ = 1 (the bonus) + accepted drafts per round, from the same rounds
        assert a["mean_acceptance_length"] == pytest.approx(1 + sum(accepted) / a["rounds"], abs=1e-9), name
    assert results["acceptance"]["DSpark"]["mean_acceptance_length"] > 1.2  # the trained pair accepts drafts

    rows = {r["system"]: r for r in results["single_stream"]["rows"]}
    ours = ["dspark scheduler", "dspark fixed γ=3", "dspark fixed γ=7", "dspark autoregressive"]
    for name in ours:
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["tokens_per_second"] > 0 and rows[name]["per_token_ms"] > 0
        assert rows[name]["greedy_check"] == {"equal": True, "mismatches": []}, name
    for name, row in rows.items():  # peers: measured and lossless, or unavailable (skipped) with a reason
        assert row["status"] == "ok" or row["status"].startswith("skipped:"), (name, row["status"])
        if row["status"] == "ok":
            assert row["greedy_check"]["equal"], (name, row["greedy_check"])

    sweep = results["load_sweep"]
    assert set(sweep) == {"dspark scheduler", "fixed γ=3", "fixed γ=7", "autoregressive"}
    for name, runs in sweep.items():
        assert [r["concurrency"] for r in runs] == [1, 3]
        for r in runs:
            assert 0 < r["tokens"] <= r["concurrency"] * 6  # a request may stop early at the stop token
            assert r["aggregate_tokens_per_second"] > 0 and r["same_tokens_as_autoregressive"], (name, r)
    assert sweep["autoregressive"][0]["mean_drafts_per_request_step"] == 0
    assert sweep["fixed γ=3"][0]["mean_drafts_per_request_step"] <= 3

    assert sorted(results["plots"]) == sorted(PLOTS)
    for name in PLOTS:
        assert (bench_out / name).read_bytes()[:8] == PNG_MAGIC
    assert "### Load sweep" in (bench_out / "report.md").read_text()


def test_greedy_check_flags_a_wrong_system(bench_out: Path) -> None:
    (engine_root,) = (bench_out / "cache").glob("engine-*")
    engine_dir = engine_root / "engine"
    base = single_stream.load_runtime(engine_dir, threads=1)
    right = next(s for s in single_stream.runtime_systems(base, stop=511, max_seq_len=128)
                 if s.name == "dspark autoregressive")

    def off_by_one(prompt: list[int], max_new_tokens: int) -> Timeline:
        timeline = right.generate(prompt, max_new_tokens)
        timeline.tokens[5] = (timeline.tokens[5] + 1) % 511
        return timeline

    prompts = [[3, 14, 15, 92, 65], [35, 89, 79]]
    reference = single_stream.run_system(right, prompts, 12, None)["outputs"]
    assert [len(r) for r in reference] == [12, 12]
    wrong = single_stream.run_system(System("wrong", "test", off_by_one), prompts, 12, reference)
    assert wrong["status"] == "ok"
    assert wrong["greedy_check"]["equal"] is False
    assert [m["prompt"] for m in wrong["greedy_check"]["mismatches"]] == [0, 1]
    assert {m["first_difference"] for m in wrong["greedy_check"]["mismatches"]} == {5}
    again = single_stream.run_system(right, prompts, 12, reference)
    assert again["greedy_check"] == {"equal": True, "mismatches": []}


def test_first_difference() -> None:
    assert single_stream.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert single_stream.first_difference([1, 9, 3], [1, 2, 3]) == 1
    assert single_stream.first_difference([1, 2], [1, 2, 3]) == 2


def test_unavailable_peer_is_reported_not_raised(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import fails
    with pytest.raises(peers.PeerUnavailable, match=r"skipped: pip install"):
        peers.genai_systems(tmp_path, tmp_path, stop=0, threads=1)

    def missing(prompt: list[int], max_new_tokens: int) -> Timeline:
        raise peers.PeerUnavailable("skipped: pip install something")

    row = single_stream.run_system(System("absent", "x", missing), [[1, 2]], 4, [[1, 2, 3, 4]])
    assert row["status"] == "skipped: pip install something" and "tokens_per_second" not in row


def test_prompt_files(tmp_path: Path) -> None:
    ids = tmp_path / "p.jsonl"
    ids.write_text('{"ids": [5, 6, 7]}\n{"ids": [8]}\n')
    assert subjects.load_prompts(ids, None, count=5, length=4, vocab_size=16, avoid=())[0] == [[5, 6, 7], [8]]
    text = tmp_path / "p.txt"
    text.write_text("def f(x):\n")
    with pytest.raises(subjects.BenchSetupError, match="no tokenizer.json"):
        subjects.load_prompts(text, None, count=1, length=4, vocab_size=16, avoid=())
    ids.write_text('{"ids": [5, 99]}\n')
    with pytest.raises(subjects.BenchSetupError, match=r"outside \[0, 16\)"):
        subjects.load_prompts(ids, None, count=1, length=4, vocab_size=16, avoid=())
    random_prompts, source = subjects.load_prompts(None, None, count=3, length=6, vocab_size=16, avoid=(0, 15))
    assert source.startswith("random") and all(len(p) == 6 and 0 not in p and 15 not in p for p in random_prompts)


def test_markov_head_off_is_a_copy() -> None:
    from dspark.models import load_pair

    vanilla = golden_path("qwen3-tiny-vanilla")
    _, drafter = load_pair(vanilla / "target", vanilla / "drafter")
    ablated = subjects.without_markov(drafter)
    assert ablated.markov_head is None and drafter.markov_head is not None
    assert ablated.lm_head.weight.data_ptr() != drafter.lm_head.weight.data_ptr()


def test_engine_without_checkpoints(bench_out: Path, tmp_path: Path) -> None:
    """--engine alone: acceptance and peers are skipped, greedy is checked against our own
    autoregressive decoding."""
    (engine_root,) = (bench_out / "cache").glob("engine-*")
    engine_dir = engine_root / "engine"
    args = ["--out", str(tmp_path), "--engine", str(engine_dir), "--num-prompts", "1", "--prompt-len", "8",
            "--new-tokens", "8", "--concurrency", "2", "--sweep-new-tokens", "4"]
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert "acceptance" not in results and results["acceptance_status"].startswith("skipped")
    assert results["single_stream"]["reference"].startswith("dspark autoregressive")
    systems = [r["system"] for r in results["single_stream"]["rows"]]
    assert systems == ["dspark scheduler", "dspark fixed γ=3", "dspark fixed γ=7", "dspark autoregressive"]
    assert all(r["greedy_check"]["equal"] for r in results["single_stream"]["rows"])
    assert "acceptance.png" not in results["plots"] and "pareto.png" in results["plots"]
