"""Prometheus metrics of an engine service in the three dimensions the monitoring framework asks for
(generation quality, system load, resource utilisation); /dashboard (dashboard.py) reads the same state.

Names follow vLLM's where a counterpart exists (`dspark:` for `vllm:`), with vLLM's meaning:
`spec_decode_num_drafts` / `_num_draft_tokens` / `_num_accepted_tokens` / `_num_accepted_tokens_per_pos`,
`num_requests_running` / `_waiting`, `time_to_first_token_seconds`, `inter_token_latency_seconds` (one
observation per delivery: with speculative decoding several tokens arrive at once, as in vLLM v1),
`request_time_per_output_token_seconds`, `e2e_request_latency_seconds`, `kv_cache_usage_perc`. dspark's own:
drafts *verified* per position (the scheduler verifies a prefix of each block, so acceptance per position is
accepted / verified), the accepted-length histogram, the per-step verification tokens and draft budget, and
a running ECE of the calibrated confidences against what verification found.

Cost on the engine's loop thread: O(R·γ) numpy and a few histogram observations per step, O(gaps) numpy per
finished request; psutil is read only when someone reads (a scrape, a dashboard poll).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..stats import RequestResult, StepRecord
from .quality import BatchHistogram, RunningECE, verification_counts

P = "dspark:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
STEPS_WINDOW = 10.0  # seconds over which dspark:engine_steps_per_second counts steps


class Service(Protocol):
    """What ServingMetrics needs of an EngineService (runtime/serving/service.py)."""

    def add_step_listener(self, fn: Callable[[StepRecord, Any], None]) -> None: ...
    def add_finish_listener(self, fn: Callable[[RequestResult, Any], None]) -> None: ...
    def snapshot(self) -> Any: ...


class ServingMetrics:
    """Subscribes to a service's step and finish listeners; `render()` is the /metrics body, `dashboard_data()`
    the dashboard's JSON. Each instance has its own CollectorRegistry (several can coexist, e.g. in tests)."""

    def __init__(self, service: Service, *, ece_bins: int = 15, ece_half_life: float = 2000.0) -> None:
        self.service = service
        self.block_size = _block_size(service)
        self.temperatures = _temperatures(service, self.block_size)
        self.registry = CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self._process = psutil.Process()
        self._engine: psutil.Process | None = None  # the engine's own process, when it runs in one
        g = self.block_size
        self.ece = RunningECE(g, bins=ece_bins, half_life=ece_half_life)
        self.accepted_length = BatchHistogram(tuple(range(1, g + 2)))  # bonus included: 1..γ+1
        self.itl = BatchHistogram(ITL_BUCKETS)
        self.pos_verified = np.zeros(g, dtype=np.int64)
        self.pos_accepted = np.zeros(g, dtype=np.int64)
        # Running totals (plain numbers) the collector and the dashboard's interval differences read.
        self.totals: dict[str, float] = dict.fromkeys(
            ("steps", "rows", "committed", "verified_tokens", "budget", "padded", "drafts", "proposed",
             "verified_drafts", "accepted_drafts", "finished", "ttft_sum", "ttft_n", "itl_sum", "itl_n",
             "generation_tokens", "prompt_tokens"), 0.0)
        self.last_cpu: float | None = None
        self.last_gpu: float | None = None
        self._step_times: deque[float] = deque()
        self._cpu_mark = (time.monotonic(), _cpu_seconds(self._processes()))
        self._process_cpu: float | None = None
        r = self.registry
        self.steps = Counter(P + "engine_steps", "Decode steps run (verification passes).", registry=r)
        self.step_seconds = Histogram(P + "engine_step_duration_seconds", "Wall time of one decode step.",
                                      buckets=STEP_BUCKETS, registry=r)
        self.step_tokens = Histogram(P + "step_verified_tokens", "Tokens the target verified per step: "
                                     "B = sum over requests of (1 + drafts verified).", buckets=TOKEN_BUCKETS,
                                     registry=r)
        self.step_budget = Histogram(P + "step_draft_budget", "Draft tokens the scheduler chose to verify per step "
                                     "(sum of the per-request lengths).", buckets=TOKEN_BUCKETS, registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time from submission to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Time from submission to the end of a request.",
                             buckets=E2E_BUCKETS, registry=r)
        self.tpot = Histogram(P + "request_time_per_output_token_seconds", "Per request: time from its first to "
                              "its last token over (generated tokens - 1).", buckets=ITL_BUCKETS, registry=r)
        self.success = Counter(P + "request_success", "Requests ended, by finish reason (stop, length, "
                               "cancelled, error).", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of ended requests.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens returned to ended requests.", registry=r)
        r.register(_Collector(self))
        service.add_step_listener(self.on_step)
        service.add_finish_listener(self.on_finish)

    # -- the loop thread ---------------------------------------------------------------------------
    def on_step(self, record: StepRecord, snapshot: Any = None) -> None:
        """One step's quality and load: counts per position, the calibration bins, the step histograms."""
        rows = record.requests
        lengths = np.asarray(record.lengths, dtype=np.int64)
        accepted = np.asarray(record.acceptance_lengths, dtype=np.int64) - 1  # drafts accepted (bonus excluded)
        # the drafter's quality (per position, calibration) over the rows it drafted: copied rows verified a
        # prompt-lookup copy, which its confidences never priced
        drafted = np.ones(rows, dtype=bool)
        drafted[list(record.copied_rows)] = False
        verified_pos, accepted_pos = verification_counts(lengths[drafted], accepted[drafted], self.block_size)
        logits = record.confidence_logits
        if logits is not None and rows:
            self.ece.update(np.asarray(logits, dtype=np.float32)[drafted], self.temperatures, lengths[drafted],
                            accepted[drafted])
        budget, tokens = int(lengths.sum()), int(record.verified_tokens)
        self.accepted_length.observe(accepted + 1)
        self.step_seconds.observe(record.total_seconds)
        self.step_tokens.observe(tokens)
        self.step_budget.observe(budget)
        self.steps.inc()
        now = time.monotonic()
        with self._lock:
            t = self.totals
            t["steps"] += 1
            t["rows"] += rows
            t["committed"] += float(accepted.sum()) + rows
            t["verified_tokens"] += tokens
            t["budget"] += budget
            t["padded"] += record.padded_tokens
            if record.drafted:
                t["drafts"] += rows
                t["proposed"] += rows * self.block_size
            t["verified_drafts"] += budget
            t["accepted_drafts"] += float(np.minimum(accepted, lengths).sum())
            self.pos_verified += verified_pos
            self.pos_accepted += accepted_pos
            self._step_times.append(now)
            while self._step_times and self._step_times[0] < now - STEPS_WINDOW:
                self._step_times.popleft()
        self.last_cpu, self.last_gpu = record.cpu_percent, record.gpu_percent

    def on_finish(self, result: RequestResult, timings: Any) -> None:
        """One ended request: TTFT, inter-token gaps, per-token time, end-to-end latency, finish reason."""
        self.success.labels(result.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(result.prompt_ids))
        self.generation_tokens.inc(len(result.tokens))
        ttft = None
        if timings is not None and timings.first_token is not None:
            ttft = timings.first_token - timings.submitted
            self.ttft.observe(ttft)
        gaps = np.asarray(getattr(timings, "gaps", ()) or (), dtype=np.float64)
        self.itl.observe(gaps)
        delivered = int(sum(getattr(timings, "delivered", ()) or ()))
        if gaps.size and delivered > 1:
            self.tpot.observe(float(gaps.sum()) / (delivered - 1))
        if timings is not None and timings.finished is not None:
            self.e2e.observe(timings.finished - timings.submitted)
        with self._lock:
            t = self.totals
            t["finished"] += 1
            t["prompt_tokens"] += len(result.prompt_ids)
            t["generation_tokens"] += len(result.tokens)
            if ttft is not None:
                t["ttft_sum"] += ttft
                t["ttft_n"] += 1
            t["itl_sum"] += float(gaps.sum())
            t["itl_n"] += gaps.size

    # -- readers (any thread) ----------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """The Prometheus exposition of this instance's registry, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def steps_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            recent = sum(1 for s in self._step_times if s >= now - STEPS_WINDOW)
        return recent / STEPS_WINDOW

    def quality_state(self) -> dict[str, Any]:
        """A consistent copy of the running totals and per-position counts."""
        with self._lock:
            return {"totals": dict(self.totals), "verified": self.pos_verified.tolist(),
                    "accepted": self.pos_accepted.tolist()}

    def resources(self) -> dict[str, float | None]:
        """Host CPU and GPU utilisation (the runtime's monitor, else the last step's reading), GPU memory, this
        process's CPU and resident memory, the host's memory use. Called on reads only."""
        cpu, gpu, gpu_memory = self.last_cpu, self.last_gpu, None
        monitor = getattr(getattr(self.service, "runtime", None), "monitor", None)
        if monitor is not None:
            reading = monitor.sample()
            cpu, gpu, gpu_memory = reading.cpu_percent, reading.gpu_percent, reading.gpu_memory_used_bytes
        return {"cpu_percent": cpu, "gpu_percent": gpu, "gpu_memory_used_bytes": gpu_memory,
                "process_cpu_percent": self._process_cpu_percent(),
                "rss_bytes": _rss_bytes(self._processes()),
                "host_memory_percent": float(psutil.virtual_memory().percent)}

    def _processes(self) -> list[psutil.Process]:
        """The serving processes: this one, and the engine's when it runs in its own (process_service.py; a
        restarted engine is a new process)."""
        pid = getattr(self.service, "engine_pid", None)
        if pid is None:
            return [self._process]
        if self._engine is None or self._engine.pid != pid:
            with contextlib.suppress(psutil.Error):
                self._engine = psutil.Process(pid)
        return [self._process, *([self._engine] if self._engine is not None else [])]

    def _process_cpu_percent(self, min_span: float = 0.5) -> float | None:
        """The serving processes' CPU use (100 = one core) since the last reading at least `min_span` s ago: its
        own mark, so readers (scrapes, dashboard polls) do not disturb the runtime monitor's psutil counter. A
        restarted engine process starts its count again: that span reads as 0 rather than negative."""
        now, used = time.monotonic(), _cpu_seconds(self._processes())
        with self._lock:
            then, before = self._cpu_mark
            if now - then >= min_span:
                self._process_cpu = max(0.0, 100.0 * (used - before) / (now - then))
                self._cpu_mark = (now, used)
            return self._process_cpu


class _Collector:
    """The values computed at scrape time: the quality counters and ECE from the running state, the load
    snapshot, resources, the batched histograms."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self.m = metrics

    def describe(self) -> list[Metric]:
        return []  # computed at scrape: nothing to check for name clashes at registration

    def collect(self) -> Iterator[Metric]:
        m = self.m
        q = m.quality_state()
        t = q["totals"]
        yield _counter("spec_decode_num_drafts", "Draft blocks proposed: one per request per step in which the "
                       "drafter ran (mean accepted length = 1 + accepted / drafts, as in vLLM).", t["drafts"])
        yield _counter("spec_decode_num_draft_tokens", "Draft tokens proposed by the drafter (gamma per draft).",
                       t["proposed"])
        yield _counter("spec_decode_num_verified_tokens", "Draft tokens the scheduler sent to verification.",
                       t["verified_drafts"])
        yield _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted by verification (bonus excluded).",
                       t["accepted_drafts"])
        yield _per_pos("spec_decode_num_accepted_tokens_per_pos", "Drafts accepted at each block position.",
                       q["accepted"])
        yield _per_pos("spec_decode_num_verified_tokens_per_pos", "Drafts verified at each block position "
                       "(acceptance at a position = accepted / verified).", q["verified"])
        yield m.accepted_length.family(P + "spec_decode_accepted_length", "Tokens committed per request per "
                                       "step: accepted drafts + the bonus token.")
        ece = m.ece.values()
        yield _gauge("spec_decode_confidence_ece", "Expected calibration error of the calibrated prefix survival "
                     "prod sigma(c_i/T_i) against acceptance, over every verified position so far (NaN: none yet).",
                     ece["ece"])
        yield _gauge("spec_decode_confidence_ece_recent", "The same ECE with older samples decayed (half-life "
                     f"{m.ece.half_life:g} samples).", ece["recent"])
        family = GaugeMetricFamily(P + "spec_decode_confidence_ece_per_pos", "ECE of the calibrated prefix "
                                   "survival at each block position.", labels=["position"])
        for j, value in enumerate(ece["per_position"]):
            family.add_metric([str(j)], _nan(value))
        yield family
        yield _counter("spec_decode_confidence_samples", "Verified (request, position) pairs in the ECE.",
                       ece["samples"])
        yield _gauge("spec_decode_confidence_calibrated", "1 when STS temperatures are applied, 0 when the raw "
                     "confidences are (no temperatures in the engine).", float(m.temperatures is not None))
        snap = m.service.snapshot()
        yield _gauge("num_requests_running", "Requests admitted to the engine (each holds a KV slot).", snap.running)
        yield _gauge("num_requests_waiting", "Requests submitted and not yet admitted.", snap.queued)
        yield _gauge("engine_steps_per_second", f"Decode steps per second over the last {STEPS_WINDOW:g} s.",
                     m.steps_per_second())
        yield _counter("step_padded_tokens", "Tokens the padded verification computed: R x (1 + max length) per "
                       "step.", t["padded"])
        yield m.itl.family(P + "inter_token_latency_seconds", "Time between two deliveries of tokens to a request "
                           "(one observation per delivery after the first).")
        yield _gauge("kv_slots_used", "KV cache slots held by running requests.", snap.running)
        yield _gauge("kv_slots_total", "KV cache slots (the most requests running at once).", snap.slots_total)
        yield _gauge("kv_tokens_used", "Target KV positions committed.", snap.kv_tokens_used)
        yield _gauge("kv_tokens_reserved", "KV positions reserved by admission control (worst case per request).",
                     snap.kv_tokens_reserved)
        yield _gauge("kv_tokens_capacity", "KV positions the engine holds in all.", snap.kv_tokens_capacity)
        capacity = max(snap.kv_tokens_capacity, 1)
        yield _gauge("kv_cache_usage_perc", "Fraction of KV positions in use (0 to 1).", snap.kv_tokens_used / capacity)
        res = m.resources()
        yield _gauge("cpu_utilization_percent", "Host CPU load, all cores (psutil, sampled by the runtime's "
                     "monitor).", res["cpu_percent"])
        if res["gpu_percent"] is not None:
            yield _gauge("gpu_utilization_percent", "GPU utilisation (NVML, device 0).", res["gpu_percent"])
        if res["gpu_memory_used_bytes"] is not None:
            yield _gauge("gpu_memory_used_bytes", "GPU memory in use (NVML, device 0).", res["gpu_memory_used_bytes"])
        yield _gauge("process_cpu_percent", "CPU use of the serving processes, the server's and its engine process's "
                     "(100 = one core; NaN until 0.5 s in).", res["process_cpu_percent"])
        yield _gauge("process_resident_memory_bytes", "Resident memory of the serving processes (the server's and its "
                     "engine process's).", res["rss_bytes"])
        yield _gauge("host_memory_used_percent", "Host memory in use.", res["host_memory_percent"])


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.Error):  # an engine process that died: its share stops counting
            times = process.cpu_times()
            total += times.user + times.system
    return total


def _rss_bytes(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            total += process.memory_info().rss
    return total


def _nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, doc, value=_nan(value))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(P + name, doc, value=float(value))


def _per_pos(name: str, doc: str, values: Sequence[int]) -> CounterMetricFamily:
    family = CounterMetricFamily(P + name, doc, labels=["position"])
    for j, value in enumerate(values):
        family.add_metric([str(j)], float(value))
    return family


def _block_size(service: Any) -> int:
    """γ draft slots per block: the runtime's model info (1 when unknown, e.g. a fake service)."""
    info = getattr(getattr(service, "runtime", None), "info", None)
    return int(getattr(info, "block_size", 0) or 1)


def _temperatures(service: Any, slots: int) -> np.ndarray | None:
    """The STS temperatures the scheduler applies (engine's config first, then the runtime's options)."""
    for owner in (getattr(service, "engine", None), getattr(getattr(service, "runtime", None), "options", None)):
        temps = getattr(getattr(owner, "scheduler", None), "confidence_temperatures", None)
        if temps is not None:
            temps = np.asarray(temps, dtype=np.float64)[:slots]
            return np.pad(temps, (0, slots - temps.size), constant_values=1.0)
    return None
