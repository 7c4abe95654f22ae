"""ServingMetrics on a fake service fed synthetic step records and finished requests: every exposed value is
checked against an independent computation (plain loops, engines/calibration.py's ECE), read back through
prometheus-client's own parser; the dashboard's interval series; and one run over the real EngineService."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark.engines.calibration import ece, survival, survival_labels
from dspark.runtime.serving.dashboard import DashboardSeries
from dspark.runtime.serving.handle import LoadSnapshot, RequestTimings
from dspark.runtime.serving.metrics import ServingMetrics
from dspark.runtime.stats import RequestResult, StepRecord

GAMMA = 4
TEMPS = (0.5, 1.0, 2.0, 1.5)


def snapshot(**changes) -> LoadSnapshot:
    base = dict(time=0.0, queued=3, running=5, slots_total=8, kv_tokens_reserved=900, kv_tokens_used=321,
                kv_tokens_capacity=2048, steps=0, submitted=9, finished=1, cancelled=0, failed=0, max_queue=64)
    return LoadSnapshot(**{**base, **changes})


class FakeService:
    """The two listener hooks, snapshot(), and the runtime attributes ServingMetrics reads."""

    def __init__(self, temperatures=TEMPS, block_size=GAMMA) -> None:
        scheduler = SimpleNamespace(confidence_temperatures=temperatures)
        self.runtime = SimpleNamespace(info=SimpleNamespace(block_size=block_size),
                                       options=SimpleNamespace(scheduler=scheduler), monitor=None)
        self.steps, self.finishes, self.snap = [], [], snapshot()

    def add_step_listener(self, fn) -> None:
        self.steps.append(fn)

    def add_finish_listener(self, fn) -> None:
        self.finishes.append(fn)

    def snapshot(self) -> LoadSnapshot:
        return self.snap

    def step(self, record: StepRecord) -> None:
        for fn in self.steps:
            fn(record, self.snap)

    def finish(self, result: RequestResult, timings: RequestTimings) -> None:
        for fn in self.finishes:
            fn(result, timings)


def synthetic_records(seed: int = 0, steps: int = 30, drafted_every: int = 5) -> list[StepRecord]:
    """Random steps: lengths ℓ in 0..γ, accepted drafts in 0..ℓ, confidences correlated with acceptance;
    every `drafted_every`-th step skips drafting (as the drafting gate does)."""
    rng = np.random.default_rng(seed)
    records = []
    for s in range(steps):
        rows = int(rng.integers(1, 7))
        drafted = s % drafted_every != drafted_every - 1
        lengths = rng.integers(0, GAMMA + 1, rows) if drafted else np.zeros(rows, dtype=np.int64)
        accepted = np.array([rng.integers(0, k + 1) for k in lengths])
        logits = rng.normal(1.0, 2.0, (rows, GAMMA)).astype(np.float32) if drafted else None
        records.append(StepRecord(
            step=s, requests=rows, admitted_new=0, lengths=lengths.tolist(),
            verified_tokens=int((lengths + 1).sum()), padded_tokens=rows * (1 + int(lengths.max())),
            acceptance_lengths=(accepted + 1).tolist(), expected_accepts=None, predicted_seconds=None,
            seconds={"verify": 0.001 * (s + 1)}, cpu_percent=10.0 + s, confidence_logits=logits, drafted=drafted))
    return records


def scrape(metrics: ServingMetrics) -> dict[tuple[str, tuple], float]:
    """Every sample of the exposition, parsed by prometheus-client: (name, sorted labels) -> value."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


@pytest.fixture
def fed():
    service = FakeService()
    metrics = ServingMetrics(service)
    records = synthetic_records()
    for record in records:
        service.step(record)
    return service, metrics, records, scrape(metrics)


def test_draft_counts_and_acceptance_per_position(fed):
    _, _, records, values = fed
    drafts = proposed = verified = accepted = 0
    per_verified, per_accepted = [0] * GAMMA, [0] * GAMMA
    for record in records:
        for k, a in zip(record.lengths, record.acceptance_lengths, strict=True):
            drafts += record.drafted
            proposed += GAMMA * record.drafted
            verified += k
            accepted += a - 1
            for j in range(GAMMA):
                per_verified[j] += j < k
                per_accepted[j] += j < a - 1
    assert values["dspark:spec_decode_num_drafts_total", ()] == drafts
    assert values["dspark:spec_decode_num_draft_tokens_total", ()] == proposed
    assert values["dspark:spec_decode_num_verified_tokens_total", ()] == verified
    assert values["dspark:spec_decode_num_accepted_tokens_total", ()] == accepted
    for j in range(GAMMA):
        pos = (("position", str(j)),)
        assert values["dspark:spec_decode_num_verified_tokens_per_pos_total", pos] == per_verified[j]
        assert values["dspark:spec_decode_num_accepted_tokens_per_pos_total", pos] == per_accepted[j]
    assert per_accepted[0] < per_verified[0] and per_verified[-1] < per_verified[0]  # the data is not degenerate


def test_accepted_length_and_step_histograms(fed):
    _, _, records, values = fed
    lengths = [a for r in records for a in r.acceptance_lengths]
    name = "dspark:spec_decode_accepted_length"
    for bound in range(1, GAMMA + 2):
        assert values[f"{name}_bucket", (("le", f"{bound:.1f}"),)] == sum(a <= bound for a in lengths)
    assert values[f"{name}_bucket", (("le", "+Inf"),)] == values[f"{name}_count", ()] == len(lengths)
    assert values[f"{name}_sum", ()] == sum(lengths)
    assert values["dspark:step_verified_tokens_sum", ()] == sum(r.verified_tokens for r in records)
    assert values["dspark:step_draft_budget_sum", ()] == sum(sum(r.lengths) for r in records)
    assert values["dspark:step_draft_budget_bucket", (("le", "4.0"),)] == sum(sum(r.lengths) <= 4 for r in records)
    assert values["dspark:engine_steps_total", ()] == len(records)
    assert values["dspark:step_padded_tokens_total", ()] == sum(r.padded_tokens for r in records)
    assert values["dspark:engine_step_duration_seconds_sum", ()] == pytest.approx(
        sum(r.total_seconds for r in records))
    assert values["dspark:engine_steps_per_second", ()] == pytest.approx(len(records) / 10.0)


def reference_ece(records, temperatures, weights=None):
    """Pooled and per-position ECE of every verified (request, position), from engines/calibration.py."""
    probs, labels, mask, w = [], [], [], []
    drafted = [r for r in records if r.confidence_logits is not None]
    for i, r in enumerate(drafted):
        probs.append(survival(r.confidence_logits.astype(np.float64), np.asarray(temperatures, dtype=np.float64)))
        labels.append(survival_labels(np.asarray(r.acceptance_lengths) - 1, GAMMA))
        mask.append(np.arange(GAMMA)[None, :] < np.asarray(r.lengths)[:, None])
        if weights is not None:
            w.append(np.full((r.requests, GAMMA), weights[i]))
    probs, labels, mask = np.concatenate(probs), np.concatenate(labels), np.concatenate(mask)
    pooled = ece(probs[mask], labels[mask])
    per_pos = [ece(probs[mask[:, j], j], labels[mask[:, j], j]) if mask[:, j].any() else None for j in range(GAMMA)]
    if weights is None:
        return pooled, per_pos, int(mask.sum())
    w = np.concatenate(w)[mask]
    p, y = probs[mask], labels[mask]
    index = np.minimum((p * 15).astype(int), 14)
    gaps = [w[index == b] @ (y[index == b] - p[index == b]) for b in range(15)]
    return sum(abs(g) for g in gaps) / w.sum()


def test_running_ece_of_calibrated_confidences(fed):
    _, _, records, values = fed
    pooled, per_pos, samples = reference_ece(records, TEMPS)
    assert values["dspark:spec_decode_confidence_ece", ()] == pytest.approx(pooled, abs=1e-9)
    assert values["dspark:spec_decode_confidence_samples_total", ()] == samples
    for j in range(GAMMA):
        assert values["dspark:spec_decode_confidence_ece_per_pos", (("position", str(j)),)] == pytest.approx(
            per_pos[j], abs=1e-9)
    assert values["dspark:spec_decode_confidence_calibrated", ()] == 1.0
    raw, _, _ = reference_ece(records, (1.0,) * GAMMA)
    assert abs(raw - pooled) > 1e-3  # the temperatures matter here, so the check above sees them


def test_ece_without_temperatures_uses_raw_confidences():
    service = FakeService(temperatures=None)
    metrics = ServingMetrics(service)
    records = synthetic_records(seed=3)
    for record in records:
        service.step(record)
    values = scrape(metrics)
    assert values["dspark:spec_decode_confidence_ece", ()] == pytest.approx(
        reference_ece(records, (1.0,) * GAMMA)[0], abs=1e-9)
    assert values["dspark:spec_decode_confidence_calibrated", ()] == 0.0


def test_recent_ece_decays_older_samples():
    half_life = 25.0
    service = FakeService()
    metrics = ServingMetrics(service, ece_half_life=half_life)
    records = synthetic_records(seed=5, steps=40)
    for record in records:
        service.step(record)
    drafted = [r for r in records if r.confidence_logits is not None]
    counts = [sum(min(k, GAMMA) for k in r.lengths) for r in drafted]  # verified positions per step
    weights = [0.5 ** (sum(counts[i + 1:]) / half_life) for i in range(len(drafted))]
    expected = reference_ece(records, TEMPS, weights)
    values = scrape(metrics)
    assert values["dspark:spec_decode_confidence_ece_recent", ()] == pytest.approx(expected, abs=1e-9)
    assert abs(expected - values["dspark:spec_decode_confidence_ece", ()]) > 1e-3


def test_empty_metrics_render_nan_ece_and_load():
    service = FakeService()
    values = scrape(ServingMetrics(service))
    assert math.isnan(values["dspark:spec_decode_confidence_ece", ()])
    assert values["dspark:num_requests_running", ()] == 5 and values["dspark:num_requests_waiting", ()] == 3
    assert values["dspark:kv_slots_used", ()] == 5 and values["dspark:kv_slots_total", ()] == 8
    assert values["dspark:kv_tokens_used", ()] == 321 and values["dspark:kv_tokens_reserved", ()] == 900
    assert values["dspark:kv_cache_usage_perc", ()] == pytest.approx(321 / 2048)
    assert values["dspark:process_resident_memory_bytes", ()] > 1e6
    assert math.isnan(values["dspark:cpu_utilization_percent", ()])  # no monitor and no step yet
    assert ("dspark:process_cpu_percent", ()) in values
    assert ("dspark:gpu_utilization_percent", ()) not in values  # no monitor, no GPU reading


def test_resources_from_the_runtime_monitor_gpu_included():
    """With NVML answering (the runtime's Monitor), the GPU gauges appear; host CPU comes from the monitor."""
    from dspark.runtime.monitor import LoadReading

    service = FakeService()
    service.runtime.monitor = SimpleNamespace(sample=lambda: LoadReading(55.0, 80.0, 123_456_789))
    values = scrape(ServingMetrics(service))
    assert values["dspark:cpu_utilization_percent", ()] == 55.0
    assert values["dspark:gpu_utilization_percent", ()] == 80.0
    assert values["dspark:gpu_memory_used_bytes", ()] == 123_456_789


def finished(submitted: float, deliveries: list[tuple[float, int]], end: float):
    timings = RequestTimings(submitted)
    for when, count in deliveries:
        timings.record(when, count)
    timings.finished = end
    return timings


def test_request_latencies_and_outcomes():
    service = FakeService()
    metrics = ServingMetrics(service)
    a = finished(10.0, [(10.5, 3), (10.7, 2), (11.2, 4)], 11.25)
    b = finished(20.0, [(20.04, 1)], 20.05)
    c = RequestTimings(30.0)
    c.finished = 30.5  # cancelled while waiting: no token
    service.finish(RequestResult(0, [1, 2, 3], list(range(9)), finish_reason="length"), a)
    service.finish(RequestResult(1, [4], [7], finish_reason="stop"), b)
    service.finish(RequestResult(2, [5, 6], [], finish_reason="cancelled"), c)
    v = scrape(metrics)
    assert v["dspark:time_to_first_token_seconds_count", ()] == 2
    assert v["dspark:time_to_first_token_seconds_sum", ()] == pytest.approx(0.5 + 0.04)
    assert v["dspark:time_to_first_token_seconds_bucket", (("le", "0.06"),)] == 1
    gaps = [0.2, 0.5]
    assert v["dspark:inter_token_latency_seconds_count", ()] == 2
    assert v["dspark:inter_token_latency_seconds_sum", ()] == pytest.approx(sum(gaps))
    assert v["dspark:inter_token_latency_seconds_bucket", (("le", "0.2"),)] == 1  # le is inclusive
    assert v["dspark:inter_token_latency_seconds_bucket", (("le", "0.15"),)] == 0
    assert v["dspark:request_time_per_output_token_seconds_count", ()] == 1  # b has one token: no per-token time
    assert v["dspark:request_time_per_output_token_seconds_sum", ()] == pytest.approx(0.7 / 8)
    assert v["dspark:e2e_request_latency_seconds_sum", ()] == pytest.approx(1.25 + 0.05 + 0.5)
    for reason, count in (("length", 1), ("stop", 1), ("cancelled", 1)):
        assert v["dspark:request_success_total", (("finished_reason", reason),)] == count
    assert v["dspark:prompt_tokens_total", ()] == 6 and v["dspark:generation_tokens_total", ()] == 10


def test_each_instance_has_its_own_registry():
    first, second = FakeService(), FakeService()
    m1, m2 = ServingMetrics(first), ServingMetrics(second)
    for record in synthetic_records(steps=4):
        first.step(record)
    assert scrape(m1)["dspark:engine_steps_total", ()] == 4
    assert scrape(m2)["dspark:engine_steps_total", ()] == 0


def test_dashboard_series_interval_values():
    service = FakeService()
    metrics = ServingMetrics(service)
    series = DashboardSeries(metrics, min_interval=0.2)
    records = synthetic_records(steps=10)
    start = series.start
    for record in records[:6]:
        service.step(record)
    assert series.sample(start + 0.5)
    assert not series.sample(start + 0.6)  # under min_interval: the same point serves
    for record in records[6:]:
        service.step(record)
    service.snap = snapshot(running=7, queued=0, kv_tokens_used=1024)
    assert series.sample(start + 1.5)
    data = json.loads(json.dumps(series.data(), allow_nan=False))  # what JSONResponse sends: no NaN
    s = data["series"]
    assert s["t"] == pytest.approx([0.5, 1.5])
    second = records[6:]
    rows, committed = sum(r.requests for r in second), sum(sum(r.acceptance_lengths) for r in second)
    assert s["accepted_length"][1] == pytest.approx(committed / rows)
    assert s["steps_per_s"] == pytest.approx([6 / 0.5, 4 / 1.0])
    assert s["tokens_per_s"][1] == pytest.approx(committed / 1.0)
    assert s["verified_per_step"][1] == pytest.approx(sum(r.verified_tokens for r in second) / 4)
    assert s["acceptance_rate"][1] == pytest.approx(
        sum(a - 1 for r in second for a in r.acceptance_lengths) / sum(sum(r.lengths) for r in second))
    assert s["running"] == [5, 7] and s["kv_used"][1] == pytest.approx(0.5)
    assert s["ttft_ms"] == [None, None]  # no request ended
    assert data["totals"]["steps"] == 10 and data["block_size"] == GAMMA and data["calibrated"] is True
    assert data["positions"]["verified"] == scrape_positions(metrics)


def scrape_positions(metrics: ServingMetrics) -> list[int]:
    values = scrape(metrics)
    return [int(values["dspark:spec_decode_num_verified_tokens_per_pos_total", (("position", str(j)),)])
            for j in range(GAMMA)]


def test_real_service_counts_match_its_results(tmp_path):
    """Over A's EngineService on the golden tiny pair: the step-side counts agree with the requests' own
    acceptance lengths and proposal lengths."""
    from test_serving_support import tiny_runtime

    from dspark.runtime.serving.service import EngineService

    with tiny_runtime(tmp_path) as rt, EngineService(rt) as service:
        metrics = ServingMetrics(service)
        handles = [service.submit(p, max_new_tokens=24, temperature=t, seed=i)
                   for i, (p, t) in enumerate([("def parse_args(", 0.0), ("The quick", 0.8), ("import os", 0.0)])]
        results = [h.result(timeout=120) for h in handles]
        service.close()  # a result is handed off before its last step's listeners run: let the loop finish
        values = scrape(metrics)
    gamma = rt.info.block_size
    assert metrics.block_size == gamma
    committed = sum(sum(r.acceptance_lengths) for r in results)
    assert values["dspark:spec_decode_accepted_length_sum", ()] == committed
    assert values["dspark:spec_decode_accepted_length_count", ()] == sum(r.rounds for r in results)
    assert values["dspark:spec_decode_num_verified_tokens_total", ()] == sum(sum(r.proposal_lengths) for r in results)
    assert values["dspark:spec_decode_num_accepted_tokens_total", ()] == committed - sum(r.rounds for r in results)
    assert values["dspark:spec_decode_num_draft_tokens_total", ()] == gamma * values[
        "dspark:spec_decode_num_drafts_total", ()]
    assert values["dspark:request_success_total", (("finished_reason", "length"),)] == 3
    assert values["dspark:time_to_first_token_seconds_count", ()] == 3
    assert values["dspark:spec_decode_confidence_samples_total", ()] > 0
    assert 0 <= values["dspark:spec_decode_confidence_ece", ()] <= 1
    assert values["dspark:num_requests_running", ()] == 0


def with_copied_rows(records: list[StepRecord]) -> list[StepRecord]:
    """Each drafted record with one more row that verified a full prompt-lookup copy, all accepted, under
    confidence −inf (a row the drafter did not draft): the drafter's quality must not see it."""
    out = []
    for r in records:
        if r.confidence_logits is None:
            out.append(r)
            continue
        logits = np.concatenate((r.confidence_logits, np.full((1, GAMMA), -np.inf, r.confidence_logits.dtype)))
        out.append(StepRecord(
            step=r.step, requests=r.requests + 1, admitted_new=0, lengths=[*r.lengths, GAMMA],
            verified_tokens=r.verified_tokens + GAMMA + 1, padded_tokens=(r.requests + 1) * (GAMMA + 1),
            acceptance_lengths=[*r.acceptance_lengths, GAMMA + 1], expected_accepts=None, predicted_seconds=None,
            seconds=r.seconds, confidence_logits=logits, drafted=False, copied_rows=(r.requests,)))
    return out


def test_copied_rows_stay_out_of_the_drafters_quality(fed):
    _, _, records, values = fed
    service = FakeService()
    metrics = ServingMetrics(service)
    for record in with_copied_rows(records):
        service.step(record)
    copied = scrape(metrics)
    for j in range(GAMMA):
        pos = (("position", str(j)),)
        for name in ("dspark:spec_decode_num_verified_tokens_per_pos_total",
                     "dspark:spec_decode_num_accepted_tokens_per_pos_total",
                     "dspark:spec_decode_confidence_ece_per_pos"):
            assert copied[name, pos] == pytest.approx(values[name, pos], abs=1e-12), (name, j)
    assert copied["dspark:spec_decode_confidence_ece", ()] == pytest.approx(values["dspark:spec_decode_confidence_ece",
                                                                                    ()], abs=1e-12)
    # the copies' own tokens still count where every verified draft does
    extra = sum(1 for r in records if r.confidence_logits is not None) * GAMMA
    assert copied["dspark:spec_decode_num_verified_tokens_total", ()] == (
        values["dspark:spec_decode_num_verified_tokens_total", ()] + extra)
