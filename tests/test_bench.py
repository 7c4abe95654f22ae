"""`dspark bench` end to end on the golden tiny models (with a tiny COST STAND-IN of the target), its
greedy-equality check, the goal comparison and the plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from conftest import golden_path

from dspark.models import load_pair
from dspark.runtime.api import Runtime
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.torch_backend import TorchBackend
from dspark.tools.bench import load_sweep, peers, plots, report, single_stream, subjects
from dspark.tools.bench.plots import PLOTS
from dspark.tools.bench.timeline import System, Timeline
from dspark.tools.bench_command import bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


SYSTEMS = {"dspark scheduler", "dspark async scheduler", "fixed γ=3", "fixed γ=7", "autoregressive"}


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory) -> Path:
    """One tiny bench run (peers included when installed) shared by the tests below, with the load
    sweep also on a COST STAND-IN of the target twice its size (made into a temporary user cache)."""
    out = tmp_path_factory.mktemp("bench")
    vanilla = golden_path("qwen3-tiny-vanilla")
    args = ["--out", str(out), "--quick", "--target", str(vanilla / "target"), "--drafter", str(vanilla / "drafter"),
            "--dflash", str(golden_path("dflash-tiny", "drafter")), "--num-prompts", "2", "--prompt-len", "12",
            "--new-tokens", "16", "--concurrency", "1,3", "--sweep-new-tokens", "6", "--standin",
            "--standin-params", "2x"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DSPARK_CACHE", str(tmp_path_factory.mktemp("user-cache")))
        result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def _engine_dir(bench_out: Path) -> Path:
    """The pair's own engine (the bench cache also holds the stand-in's)."""
    return Path(json.loads((bench_out / "results.json").read_text())["subjects"]["runtime_dir"])


def test_results_schema_and_plots(bench_out: Path) -> None:
    results = json.loads((bench_out / "results.json").read_text())
    assert results["schema_version"] == 2
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

    own, standin = results["load_sweeps"]
    assert own["target"] == "target qwen3-tiny-vanilla/target (213.7k)" and own["standin"] is None
    assert standin["target"] == "COST STAND-IN target (428k)"
    for entry in (own, standin):
        sweep = entry["schedulers"]
        assert set(sweep) == SYSTEMS
        for name, runs in sweep.items():
            assert [r["concurrency"] for r in runs] == [1, 3]
            for r in runs:
                # max(C, 16) requests, C at a time: a new one as each ends (1 request: 16 one after another)
                assert r["requests"] == max(r["concurrency"], load_sweep.MIN_REQUESTS)
                assert r["max_requests_per_step"] == r["concurrency"]
                assert 0 < r["tokens"] <= r["requests"] * 6  # a request may stop early at the stop token
                assert r["aggregate_tokens_per_second"] > 0 and r["per_request_tokens_per_second"] > 0
                assert r["per_request_decode_tokens_per_second"] > 0  # (up to 6 tokens: some after the first step)
                # --sweep-repeats' default, three times over at a few requests; the row is the median run
                assert len(r["aggregate_runs"]) == 3 * load_sweep.SHORT_RUN_REPEATS
                assert r["aggregate_tokens_per_second"] == sorted(r["aggregate_runs"])[4]
                assert r["same_tokens_as_autoregressive"], (entry["target"], name, r)
                assert r["ratio_to_autoregressive"] == pytest.approx(
                    r["aggregate_tokens_per_second"] / sweep["autoregressive"][runs.index(r)]
                    ["aggregate_tokens_per_second"], abs=1e-3)
        assert sweep["autoregressive"][0]["mean_drafts_per_request_step"] == 0
        assert sweep["autoregressive"][0]["ratio_to_autoregressive"] == 1.0
        assert sweep["fixed γ=3"][0]["mean_drafts_per_request_step"] <= 3
        assert [e["concurrency"] for e in entry["comparison"]] == [1, 3]
        assert entry["confidences"] == "raw confidences (not STS-calibrated)"  # a given pair: no data to calibrate on
        for e in entry["comparison"]:
            assert set(e["schedulers"]) == {"dspark scheduler", "dspark async scheduler"}
            assert e["bar_tokens_per_second"] == max(e["autoregressive_tokens_per_second"],
                                                     e["best_fixed_tokens_per_second"])
            assert all(isinstance(x["meets_goal"], bool) for x in e["schedulers"].values())

    record = standin["standin"]  # the stand-in's provenance, labelled as one
    assert record["label"].startswith("COST STAND-IN") and record["params"] >= 2 * record["source_params"]
    assert record["source"] == str(golden_path("qwen3-tiny-vanilla", "target").resolve())
    assert Path(record["checkpoint_dir"]).name == "standin-target-427.4k"
    assert results["subjects"]["standin"] == record
    assert record["runtime_dir"] != results["subjects"]["runtime_dir"]

    assert sorted(results["plots"]) == sorted(PLOTS)
    for name in PLOTS:
        assert (bench_out / name).read_bytes()[:8] == PNG_MAGIC
    text = (bench_out / "report.md").read_text()
    assert "### Load sweep" in text and "### Goal: scheduler ≥ max(autoregressive, best fixed γ)" in text
    sweep_rows = [line for line in text.splitlines() if line.startswith("| COST STAND-IN target (428k) |")]
    assert len(sweep_rows) == 2 * len(SYSTEMS) + 2  # every stand-in row of the sweep and goal tables says so
    assert "vLLM's published DSpark numbers on a large GPU model (not measured here)" in text
    assert "adaptive 2.66× at 1, 1.81× at 16, 1.54× at 256; fixed k=7 1.20× at 256" in text


def test_greedy_check_flags_a_wrong_system(bench_out: Path) -> None:
    base = single_stream.load_runtime(_engine_dir(bench_out), threads=1)
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
    with pytest.raises(peers.PeerUnavailable, match=r"skipped: pip install"):
        peers.genai_int4_greedy(tmp_path, tmp_path, threads=1)

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
    args = ["--out", str(tmp_path), "--engine", str(_engine_dir(bench_out)), "--num-prompts", "1", "--prompt-len", "8",
            "--new-tokens", "8", "--concurrency", "2", "--sweep-new-tokens", "4"]
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert "acceptance" not in results and results["acceptance_status"].startswith("skipped")
    assert results["single_stream"]["reference"].startswith("dspark autoregressive")
    systems = [r["system"] for r in results["single_stream"]["rows"]]
    assert systems == ["dspark scheduler", "dspark scheduler, no prompt lookup", "dspark fixed γ=3", "dspark fixed γ=7",
                       "dspark autoregressive"]
    assert all(r["greedy_check"]["equal"] for r in results["single_stream"]["rows"])
    assert "acceptance.png" not in results["plots"] and "pareto.png" in results["plots"]


def _row(c: int, aggregate: float, per_request: float | None = None) -> dict:
    """A made-up sweep row: only what compare, the report and the plots read."""
    per_request = aggregate / c if per_request is None else per_request
    return {"concurrency": c, "aggregate_tokens_per_second": aggregate, "per_request_tokens_per_second": per_request,
            "per_request_decode_tokens_per_second": 2 * per_request,
            "mean_drafts_per_request_step": 1.0, "mean_verified_tokens_per_step": 2.0 * c,
            "rejected_draft_fraction": 0.5, "mean_acceptance_length": 2.0, "same_tokens_as_autoregressive": True}


def _made_up_sweep() -> dict[str, list[dict]]:
    return {  # at 1 request the best fixed γ sets the bar, at 16 autoregressive does
        "dspark scheduler": [_row(1, 199.0), _row(16, 310.0)],
        "dspark async scheduler": [_row(1, 200.0), _row(16, 299.0)],
        "fixed γ=3": [_row(1, 150.0), _row(16, 250.0)],
        "fixed γ=7": [_row(1, 200.0), _row(16, 100.0)],
        "autoregressive": [_row(1, 100.0, per_request=80.0), _row(16, 300.0)],
    }


def test_a_requests_decode_speed_runs_from_its_first_token(monkeypatch) -> None:
    """run_load's per-request decode speed: tokens after the first over the time from the end of the step that
    admitted (prefilled) the request to the end of the step it finished in, on a clock the test controls."""
    clock = iter(range(1000))

    def perf_counter() -> float:
        return float(next(clock))

    target, drafter = load_pair(golden_path("qwen3-tiny-vanilla", "target"),
                                golden_path("qwen3-tiny-vanilla", "drafter"))
    runtime = Runtime(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter))
    monkeypatch.setattr(load_sweep, "time", SimpleNamespace(perf_counter=perf_counter))  # the sweep's clock alone
    run = load_sweep.run_load(runtime, SchedulerConfig("off"), [[1, 2, 3], [4, 5, 6]], concurrency=1,
                              max_new_tokens=4, stop=target.config.vocab_size - 1)
    assert [len(tokens) for tokens in run["outputs"]] == [4, 4]  # (neither met the stop token)
    # one slot, plain decoding, 4 tokens each: request 1 is prefilled in step 0, which decodes its second token,
    # and ends in step 2; request 2 is submitted after step 2 and runs steps 3-5. A clock tick per call: begin 0,
    # submit 1, step ends 2, 3, 4 (then submit 5), 6, 7, 8: each has 2 tokens when its first step ends and decodes 2
    # more over 2 ticks; from its submission, 4 tokens over 3 ticks
    assert run["per_request_decode_tokens_per_second"] == pytest.approx(1.0)
    assert run["per_request_tokens_per_second"] == pytest.approx(4 / 3, abs=0.01)


def test_goal_is_the_best_of_autoregressive_and_fixed_gamma() -> None:
    sweep = _made_up_sweep()
    one, sixteen = load_sweep.compare(sweep)
    assert (one["concurrency"], one["best_fixed"], one["bar_tokens_per_second"]) == (1, "fixed γ=7", 200.0)
    assert (sixteen["best_fixed"], sixteen["bar_tokens_per_second"]) == ("fixed γ=3", 300.0)
    assert one["autoregressive_tokens_per_second"] == 100.0
    sync, async_ = one["schedulers"]["dspark scheduler"], one["schedulers"]["dspark async scheduler"]
    assert sync["meets_goal"] is False  # 199 beats autoregressive (100) but not fixed γ=7 (200)
    assert async_["meets_goal"] is True  # equal to the bar counts
    assert sync["ratio_to_bar"] == 0.995 and sync["ratio_to_autoregressive"] == 1.99
    assert sync["per_request_ratio_to_autoregressive"] == pytest.approx(199 / 80, abs=1e-3)
    assert sixteen["schedulers"]["dspark scheduler"]["meets_goal"] is True  # 310 >= 300
    assert sixteen["schedulers"]["dspark async scheduler"]["meets_goal"] is False  # 299 < autoregressive's 300
    # ratios are written into every row as well
    assert sweep["fixed γ=7"][1]["ratio_to_autoregressive"] == 0.333
    assert sweep["autoregressive"][0]["ratio_to_autoregressive"] == 1.0

    no_scheduler = load_sweep.compare({"autoregressive": [_row(4, 10.0)]})
    assert no_scheduler[0]["schedulers"] == {} and no_scheduler[0]["bar_tokens_per_second"] == 10.0
    alone = load_sweep.compare({"dspark scheduler": [_row(4, 10.0)]})[0]["schedulers"]["dspark scheduler"]
    assert alone["meets_goal"] is None and alone["ratio_to_autoregressive"] is None

    sweeps = [{"target": "COST STAND-IN target (100M)", "standin": None, "schedulers": sweep,
               "comparison": [one, sixteen]}]
    table = report.goal_table(sweeps).splitlines()
    assert table[2].startswith("| COST STAND-IN target (100M) | 1 | 100.0 | 200.0 (fixed γ=7) | 199.0 | 0.995 | no |")
    assert table[3].endswith("| 310.0 | 1.03 | yes | 299.0 | 0.997 | no |")
    summary = report.goal_summary(sweeps)
    assert ("dspark scheduler: ≥ max(autoregressive, best fixed γ) at 1 of 2 concurrencies (not at 1 requests)"
            in summary)
    assert "per-request speed ÷ autoregressive 2.49× at 1, 1.03× at 16" in summary
    assert "per-user decode speed ÷ autoregressive 2.49× at 1, 1.03× at 16" in summary


def test_load_sweep_shuffles_who_follows_whom(monkeypatch) -> None:
    """Every scheduler runs `repeats` times per concurrency (three times that where runs are short), in an order
    that changes from repeat to repeat, after one untimed warm-up run of each (short requests, not in the rows)."""
    ran: list[tuple[str, int]] = []
    warm_ups: list[tuple[str, int]] = []

    def fake_run(base, scheduler, batch, *, concurrency, max_new_tokens, stop):
        name = scheduler.mode if scheduler.mode != "fixed" else f"fixed{scheduler.fixed_length}"
        (warm_ups if max_new_tokens == load_sweep.WARM_UP_TOKENS else ran).append((name, concurrency))
        seconds = 0.1 if concurrency < 64 else 1.0  # short runs at 1 and 4 requests
        tokens_per_second = 1e6 if max_new_tokens == load_sweep.WARM_UP_TOKENS else 1.0  # (a warm-up in a row: seen)
        return {"concurrency": concurrency, "aggregate_tokens_per_second": tokens_per_second, "seconds": seconds,
                "outputs": [[1]]}

    monkeypatch.setattr(load_sweep, "run_load", fake_run)
    base = SimpleNamespace(info=SimpleNamespace(block_size=7, has_confidence=True))
    rows = load_sweep.load_sweep(base, [[1, 2]], [1, 4, 64], max_new_tokens=8, stop=0, repeats=4, progress=False)
    assert all(len(r) == 3 for r in rows.values()) and len(rows) == 5
    assert all(r["aggregate_runs"] == [1.0] * len(r["aggregate_runs"]) for rs in rows.values() for r in rs)
    assert sorted(warm_ups) == sorted((name, c) for c in (1, 4, 64) for name in {name for name, _ in ran})
    for c, runs in ((1, 12), (4, 12), (64, 4)):
        order = [name for name, at in ran if at == c]
        assert len(order) == 5 * runs
        repeats = [tuple(order[i : i + 5]) for i in range(0, len(order), 5)]
        assert all(sorted(r) == sorted(repeats[0]) for r in repeats)  # each scheduler once a repeat
        assert len(set(repeats)) > 1  # (a fixed order: every repeat the same)


def test_plots_label_every_target(monkeypatch, tmp_path: Path) -> None:
    """Each sweep plot has a panel per target titled with its label, the ratio plot draws vLLM's
    published figures as a labelled reference, and the PNGs are written."""
    texts: dict[str, list[str]] = {}
    save = plots._save

    def recording_save(fig, path, *args, **kwargs):
        texts[path.name] = [t.get_text() for ax in fig.axes for t in
                            [ax.title, *(ax.get_legend().get_texts() if ax.get_legend() else [])]]
        texts[path.name] += [t.get_text() for t in fig.texts]
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(plots, "_save", recording_save)
    sweeps = []
    for label in ("demo target (5.2M)", "COST STAND-IN target (100M)"):
        sweep = _made_up_sweep()
        sweeps.append({"target": label, "standin": None, "schedulers": sweep, "comparison": load_sweep.compare(sweep)})
    made = plots.write_plots({"load_sweeps": sweeps, "vllm_reference": load_sweep.VLLM_REFERENCE}, tmp_path)
    assert made == ["pareto.png", "budget.png", "ratio.png"]
    for name in made:
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
        for label in ("demo target (5.2M)", "COST STAND-IN target (100M)"):
            assert any(text.startswith(label) for text in texts[name]), (name, label)
    ratio = "\n".join(texts["ratio.png"])
    assert "vLLM published, adaptive (large GPU model; not ours)" in ratio
    assert "vLLM published, fixed k=7 (large GPU model; not ours)" in ratio
    assert "vLLM's published DSpark numbers on a large GPU model (not measured here)" in ratio


def test_standin_needs_a_checkpoint_and_a_larger_size(bench_out: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "user-cache"))
    args = ["--out", str(tmp_path), "--engine", str(_engine_dir(bench_out)), "--standin", "--sweep-only"]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 2 and "--standin inflates the target checkpoint" in result.output
    vanilla = golden_path("qwen3-tiny-vanilla")
    chosen = subjects.Subjects(tmp_path, vanilla / "target", vanilla / "drafter", None, "checkpoints")
    with pytest.raises(subjects.BenchSetupError, match="--standin-params: .* not more than the target's"):
        subjects.standin_checkpoint(chosen, "100k")
    assert not (tmp_path / "user-cache").exists()  # refused before writing anything


def test_single_stream_rounds_report_the_median_round_and_every_rounds_ratio() -> None:
    """Rounds interleave: round i of every system runs in the same stretch. A row is its median round, every
    round's tokens/s beside it; a lossless system wrong in one round only is flagged; the ratios to a peer are
    taken round by round, with their min and median."""
    calls = {"fast": 0, "slow": 0, "flaky": 0}
    speeds = {"fast": [400.0, 100.0, 200.0], "slow": [100.0, 100.0, 100.0]}  # tokens/s per round

    def system(name: str, lossless: bool = True) -> System:
        def generate(prompt: list[int], max_new_tokens: int) -> Timeline:
            calls[name] += 1
            at = (calls[name] - 2) // 2  # round of this call: one warm-up, then two prompts a round
            timeline = Timeline(start=0.0)
            tokens = [p + 1 for p in prompt][:max_new_tokens]
            if name == "flaky" and at == 1:
                tokens[0] += 1
            seconds = len(tokens) / speeds.get(name, [50.0] * 3)[max(at, 0)]
            timeline.times, timeline.counts, timeline.tokens = [seconds], [len(tokens)], tokens
            return timeline
        return System(name, "test", generate, lossless)

    prompts, reference = [[1, 2, 3, 4], [5, 6, 7, 8]], [[2, 3, 4, 5], [6, 7, 8, 9]]
    rows = {r["system"]: r for r in single_stream.run_systems(
        [system("fast"), system("slow"), system("flaky")], prompts, 4, reference, rounds=3)}
    assert rows["fast"]["tokens_per_second_runs"] == [400.0, 100.0, 200.0]
    assert rows["fast"]["tokens_per_second"] == 200.0  # the median round
    assert rows["fast"]["greedy_check"]["equal"] and not rows["flaky"]["greedy_check"]["equal"]
    assert [m["prompt"] for m in rows["flaky"]["greedy_check"]["mismatches"]] == [2, 3]  # round 1's requests
    named = [{**rows["fast"], "system": "dspark scheduler"}, {**rows["slow"], "system": "onnxruntime-genai greedy"}]
    (ratio,) = report.single_stream_ratios(named)
    assert ratio["ratios"] == [4.0, 1.0, 2.0] and ratio["min"] == 1.0 and ratio["median"] == 2.0
    assert "median 2.00×, min 1.00× over 3 round(s) (goal ≥ 1.3×: met" in report.ratio_lines([ratio])
    with pytest.raises(ValueError, match="rounds"):
        single_stream.run_systems([system("slow")], prompts, 4, reference, rounds=0)
