"""The public runtime API: `Runtime.load(dir)`, `generate(...)`, `stream(...)`, `close()`.

    rt = Runtime.load("out/engine")                      # the backend engine.json names (ORT, TensorRT)
    rt = Runtime.load("out/export")                      # ONNX Runtime on a dspark-export dir
    rt = Runtime.from_checkpoints("target/", "drafter/")  # PyTorch reference backend
    results = rt.generate([[1, 2, 3], [4, 5]], max_new_tokens=64, temperature=0.0, seed=0)
    for tokens in rt.stream([1, 2, 3], max_new_tokens=64): ...

Text works wherever ids do, with the pair's tokenizer.json (the engine or export dir, or the target
checkpoint): a text prompt (or a stop string) gives `TextResult`s, which carry `text` beside the ids,
and `stream` of a text prompt yields text. `chat(messages)` renders tokenizer_config.json's chat template.

    rt.generate("def parse_args(", max_new_tokens=64, stop=["\n\n", *rt.info.eos_token_ids])[0].text

An engine directory brings its measured SPS table and STS temperatures; for an export directory or
checkpoints the SPS cost model is profiled at load (a few dozen real decode steps) unless one is given.
Bad artifacts raise ArtifactError, malformed requests RequestError, both with one clear line.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from dspark.export.engine_dir import is_engine_dir, load_engine_dir
from dspark.export.manifest import read_manifest

from .backend import Backend
from .backend_registry import open_backend
from .batch_loop import BatchEngine
from .capacity import Capacity
from .cost_model import StepCost
from .kv_tiers import HostTier
from .live_cost import LiveStepCost
from .model_info import ModelInfo
from .model_text import Prompt, Stop, TextMethods
from .monitor import Monitor, acquire_monitor, release_monitor
from .ort_backend import OrtBackend
from .prefix_scheduler import SchedulerConfig
from .profiling import profile_step_cost
from .requests import RequestError, as_list, token_ids
from .stats import EngineStats, RequestResult
from .text import StopWatch, TextCodec, TextStream, cut_text


@dataclass
class TextResult(RequestResult):
    """A result with its output as text too: special tokens left out, cut before a stop string."""

    text: str = ""


@dataclass(frozen=True)
class RuntimeOptions:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_mode: str | None = None  # target graph flavour (target_runner.KV_MODES); None: the best there is
    max_requests: int = 64
    max_seq_len: int = 1024
    max_tokens: int | None = None  # None = max_requests * max_seq_len
    profile_requests: tuple[int, ...] = (1, 4, 16)
    live_cost: bool = True  # each engine keeps the cost model current from its timed steps (LiveStepCost)
    host_kv_tokens: int = 0  # KV positions a host tier holds for requests swapped out under slot pressure (kv_tiers)


class Runtime(TextMethods):
    """A model pair on an open backend. Close it (or use `with`) to release sessions or plans."""

    def __init__(self, backend: Backend, info: ModelInfo, options: RuntimeOptions | None = None,
                 cost_model: StepCost | None = None, *, text_dirs: Sequence[str | Path] = ()) -> None:
        """`text_dirs`: where to look for tokenizer.json (read on first use of text)."""
        options = options or RuntimeOptions()
        backend.open()
        self.backend, self.info, self.options = backend, info, options
        if cost_model is None and options.scheduler.needs_cost_model:
            cost_model = profile_step_cost(backend, info, kv_mode=options.kv_mode,
                                           requests=options.profile_requests)
        self.cost_model = cost_model
        self.stats = EngineStats()
        self.monitor: Monitor | None = acquire_monitor()  # the process's sampling thread, while this runtime lives
        self.text_dirs = tuple(Path(d) for d in text_dirs)
        self._codec: TextCodec | None = None
        self._engine: BatchEngine | None = None  # generate/stream reuse it: its buffers are sized once
        self._engine_free = threading.Lock()

    @classmethod
    def load(cls, path: str | Path, options: RuntimeOptions | None = None, *,
             threads: int | None = None, cost_model: StepCost | None = None) -> Runtime:
        """An engine directory, on the backend its engine.json names, with its measured SPS table and
        STS temperatures; or a plain export directory on ONNX Runtime (the cost model is profiled at
        start-up). `threads` is ORT's intra-op thread count (0: every core). An export directory
        defaults to 1, an engine to the count its table was measured with; another count for an ORT
        engine keeps that table as the starting point, which the live cost model corrects from timed
        steps (`RuntimeOptions.live_cost`)."""
        path = Path(path)
        if not is_engine_dir(path):
            backend = OrtBackend(path, intra_op_threads=1 if threads is None else threads)
            return cls(backend, ModelInfo.from_manifest(backend.manifest), options, cost_model, text_dirs=(path,))
        engine = load_engine_dir(path)
        if threads is not None and threads != engine.intra_op_threads and engine.backend != "onnxruntime":
            raise ValueError(f"threads={threads}: an intra-op thread count applies to ONNX Runtime engines; "
                             f"{path} runs on {engine.backend}")
        options = options or RuntimeOptions()
        if options.kv_mode is None:
            options = replace(options, kv_mode=engine.kv_mode)
        if cost_model is None:
            cost_model = engine.cost_model(options.kv_mode)
        if options.scheduler.confidence_temperatures is None and engine.confidence_temperatures:
            scheduler = replace(options.scheduler, confidence_temperatures=engine.confidence_temperatures)
            options = replace(options, scheduler=scheduler)
        info = ModelInfo.from_manifest(read_manifest(engine.contract_dir, verify="none"))
        backend = (open_backend(engine) if threads is None or threads == engine.intra_op_threads
                   else OrtBackend.for_engine(engine, threads).open())
        return cls(backend, info, options, cost_model, text_dirs=(path, Path(engine.contract_dir)))

    @classmethod
    def from_checkpoints(cls, target_dir: str | Path, drafter_dir: str | Path,
                         options: RuntimeOptions | None = None, *,
                         cost_model: StepCost | None = None, device: str = "cpu") -> Runtime:
        """The PyTorch backend over the checkpoints, on `device` ("cuda": the target's KV cache on the GPU,
        recurring layouts replayed as CUDA graphs; see runtime/torch_backend.py)."""
        from dspark.models import load_pair

        from .torch_backend import TorchBackend

        target, drafter = load_pair(target_dir, drafter_dir)
        return cls(TorchBackend(target, drafter, device=device), ModelInfo.from_models(target, drafter), options,
                   cost_model, text_dirs=(Path(target_dir),))

    def detach(self) -> None:
        """Let go of what this runtime holds beside its backend (its share of the monitor): for a runtime over a
        backend that another runtime owns and closes. Idempotent."""
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            release_monitor(monitor)

    def close(self) -> None:
        self.detach()
        self.backend.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def engine(self, step_history: int | None = 1024) -> BatchEngine:
        """A fresh BatchEngine on this runtime's backend and options; `step_history` steps of stats kept."""
        o = self.options
        capacity = Capacity(o.max_requests, o.max_tokens or o.max_requests * o.max_seq_len, o.max_seq_len)
        # only schedulers that price steps get the cost model: keeping it current costs ~50 µs a step
        # (a tenth of a single-stream autoregressive step here), which `off` and `fixed` would pay for nothing
        cost_model = self.cost_model if o.scheduler.needs_cost_model else None
        cost_model = LiveStepCost(cost_model) if o.live_cost and cost_model else cost_model
        return BatchEngine(self.backend, self.info, capacity=capacity, scheduler=o.scheduler,
                           cost_model=cost_model, monitor=self.monitor, kv_mode=o.kv_mode,
                           step_history=step_history,
                           host_tier=HostTier(o.host_kv_tokens) if o.host_kv_tokens else None)

    @contextmanager
    def _claimed_engine(self) -> Iterator[BatchEngine]:
        """The runtime's own engine, fresh stats, for one call; a new engine while another call (a
        stream not yet finished, another thread) holds it."""
        if not self._engine_free.acquire(blocking=False):
            yield self.engine()
            return
        try:
            if self._engine is None or not self._engine.idle:
                self._engine = self.engine()
            self._engine.stats = EngineStats(history=self._engine.stats.steps.maxlen)
            yield self._engine
        finally:
            self._engine_free.release()

    # -- text (tokenizer, encode, decode, chat_prompt, prompt_ids, split_stop: TextMethods) ----------------
    def text_result(self, result: RequestResult, stops: Sequence[str] = ()) -> TextResult:
        """`result` with its text (cut before the first stop string)."""
        fields = {name: getattr(result, name) for name in result.__dataclass_fields__}
        return TextResult(**fields, text=cut_text(self.decode(result.tokens), stops))

    # -- decoding -----------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Prompt | Sequence[str | Prompt],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        stop: Stop = (),
    ) -> list[RequestResult]:
        """Prompts (one, or a list; token ids or text) -> one result per prompt, in order. Prompt i uses
        seed + i. All prompts are validated before any is queued; a prompt that is neither text nor a
        sequence of token ids raises RequestError. `stop` holds token ids and/or strings; with text
        in (a text prompt or a stop string) every result is a TextResult."""
        with_text = _has_text(prompts, stop)
        if with_text:
            batch = _prompt_batch([self.prompt_ids(p) for p in _text_batch(prompts)])
            stop_ids, strings = self.split_stop(stop)
        else:
            batch, stop_ids, strings = _prompt_batch(prompts), stop, ()
        with self._claimed_engine() as engine:
            ids = [engine.submit(p, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i,
                                 stop_token_ids=stop_ids) for i, p in enumerate(batch)]
            if not with_text:
                finished = engine.run_until_done()
            else:
                watches = {i: StopWatch(self.tokenizer, strings) for i in ids}
                finished = {}
                while not engine.idle:
                    engine.step()
                    finished.update(finish_at_stop_strings(engine, watches))
            self.stats = engine.stats
        if not with_text:
            return [finished[i] for i in ids]
        return [self.text_result(finished[i], strings) for i in ids]

    def chat(self, messages: object, *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
             stop: Stop = ()) -> TextResult:
        """One conversation through the chat template -> its reply as a TextResult."""
        stop_ids, strings = self.split_stop(stop)
        (result,) = self.generate(self.chat_prompt(messages), max_new_tokens=max_new_tokens,
                                  temperature=temperature, seed=seed, stop=stop_ids)
        return self.text_result(result, strings)

    def stream(
        self,
        prompt: str | Prompt,
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        stop: Stop = (),
    ) -> Iterator[list[int]] | Iterator[str]:
        """Yield the newly committed tokens of one request after every step (cut at max_new_tokens
        and at a stop token exactly as `generate` cuts them); for a text prompt or with stop strings,
        yield text pieces instead, which join to `generate(...)[0].text`."""
        if not _has_text(prompt, stop):
            return self._stream_ids(prompt, max_new_tokens, temperature, seed, stop)
        stop_ids, strings = self.split_stop(stop)
        return self._stream_text(self.prompt_ids(prompt), max_new_tokens, temperature, seed, stop_ids, strings)

    def _stream_ids(self, prompt: Prompt, max_new_tokens: int, temperature: float, seed: int,
                    stop: Stop) -> Iterator[list[int]]:
        with self._claimed_engine() as engine:
            request = engine.submit(prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                    stop_token_ids=stop)
            sent = 0
            while not engine.idle:
                engine.step()
                tokens = engine.tokens_so_far(request)
                if len(tokens) > sent:
                    yield tokens[sent:]
                    sent = len(tokens)
            engine.take_result(request)
            self.stats = engine.stats

    def _stream_text(self, prompt: Prompt, max_new_tokens: int, temperature: float, seed: int,
                     stop_ids: Sequence[int], strings: tuple[str, ...]) -> Iterator[str]:
        with self._claimed_engine() as engine:
            request = engine.submit(prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                    stop_token_ids=stop_ids)
            watches = {request: StopWatch(self.tokenizer, strings)}
            text, sent = TextStream(self.tokenizer, strings), 0
            done: dict[int, RequestResult] = {}
            while not engine.idle:
                engine.step()
                done.update(finish_at_stop_strings(engine, watches))
                tokens = done[request].tokens if request in done else engine.tokens_so_far(request)
                if len(tokens) > sent and (piece := text.push(tokens[sent:])):
                    yield piece
                sent = max(sent, len(tokens))
            if piece := text.finish(self.text_result(done[request], strings).text):
                yield piece
            self.stats = engine.stats


def finish_at_stop_strings(engine: BatchEngine, watches: dict[int, StopWatch]) -> dict[int, RequestResult]:
    """After a step: hand off every finished result, and end each watched request whose output now holds
    a stop string, cut just after the token that completed it (finish reason "stop"). The one rule for
    `Runtime.generate` and the server, so both end a request at the same token."""
    done = engine.take_finished()
    cuts = {}
    for request_id, watch in list(watches.items()):
        cut = watch.check(done[request_id].tokens if request_id in done else engine.tokens_so_far(request_id))
        if cut is not None and request_id not in done and engine.cancel(request_id):
            done[request_id] = engine.take_result(request_id)
        if cut is not None:
            cuts[request_id] = cut
        if request_id in done:
            del watches[request_id]
    for request_id, cut in cuts.items():
        result = done[request_id]
        result.tokens, result.finish_reason = result.tokens[:cut], "stop"
    return done


def _has_text(prompts: object, stop: object) -> bool:
    if isinstance(prompts, str) or isinstance(stop, str):
        return True
    text_prompt = isinstance(prompts, list | tuple) and any(isinstance(p, str) for p in prompts)
    text_stop = isinstance(stop, list | tuple) and any(isinstance(s, str) for s in stop)
    return text_prompt or text_stop


def _text_batch(prompts: object) -> list[object]:
    """One prompt (text or ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = as_list(prompts)
    if isinstance(prompts, list | tuple) and prompts and all(not isinstance(p, str) and not isinstance(p, Sequence)
                                                             for p in prompts):
        return [prompts]  # one id prompt
    return list(prompts) if isinstance(prompts, list | tuple) else [prompts]


def _prompt_batch(prompts: object) -> list[list[int]]:
    """One prompt (a sequence of ids) or a sequence of prompts -> a list of id lists."""
    prompts = as_list(prompts)
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or not prompts:
        raise RequestError(f"prompts must be a sequence of token ids or a list of them, got {prompts!r:.80}")
    if all(not isinstance(p, Sequence) or isinstance(p, str | bytes) for p in prompts):
        return [token_ids(prompts)]
    return [token_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
