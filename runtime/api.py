"""The public runtime API: `Runtime.load(dir)`, `generate(...)`, `stream(...)`, `close()`.

    rt = Runtime.load("out/engine")                      # the backend engine.json names (ORT, TensorRT)
    rt = Runtime.load("out/export")                      # ONNX Runtime on a dspark-export dir
    rt = Runtime.from_checkpoints("target/", "drafter/")  # PyTorch reference backend
    results = rt.generate([[1, 2, 3], [4, 5]], max_new_tokens=64, temperature=0.0, seed=0)
    for tokens in rt.stream([1, 2, 3], max_new_tokens=64): ...

An engine directory brings its measured SPS table and STS temperatures; for an export directory or
checkpoints the SPS cost model is profiled at load (a few dozen real decode steps) unless one is given.
Bad artifacts raise ArtifactError, malformed requests RequestError, both with one clear line.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from dspark.export.engine_dir import is_engine_dir, load_engine_dir
from dspark.export.manifest import read_manifest

from .backend import Backend
from .backend_registry import open_backend
from .batch_loop import DEFAULT_KV_MODE, BatchEngine
from .cost_model import StepCost
from .kv_cache import Capacity
from .model_info import ModelInfo
from .monitor import Monitor
from .ort_backend import OrtBackend
from .prefix_scheduler import SchedulerConfig
from .profiling import profile_step_cost
from .requests import RequestError, as_list, token_ids
from .stats import EngineStats, RequestResult

Prompt = Sequence[int]


@dataclass(frozen=True)
class RuntimeOptions:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_mode: str = DEFAULT_KV_MODE
    max_requests: int = 64
    max_seq_len: int = 1024
    max_tokens: int | None = None  # None = max_requests * max_seq_len
    profile_requests: tuple[int, ...] = (1, 4, 16)


class Runtime:
    """A model pair on an open backend. Close it (or use `with`) to release sessions or plans."""

    def __init__(self, backend: Backend, info: ModelInfo, options: RuntimeOptions | None = None,
                 cost_model: StepCost | None = None) -> None:
        options = options or RuntimeOptions()
        backend.open()
        self.backend, self.info, self.options = backend, info, options
        if cost_model is None and options.scheduler.mode == "dspark":
            cost_model = profile_step_cost(backend, info, kv_mode=options.kv_mode,
                                           requests=options.profile_requests)
        self.cost_model = cost_model
        self.stats = EngineStats()
        self.monitor = Monitor()  # one sampling thread for the runtime's lifetime

    @classmethod
    def load(cls, path: str | Path, options: RuntimeOptions | None = None, *,
             threads: int = 1, cost_model: StepCost | None = None) -> Runtime:
        """An engine directory, on the backend its engine.json names, with its measured SPS table and
        STS temperatures; or a plain export directory on ONNX Runtime (the cost model is profiled at
        start-up). `threads` is ORT's intra-op thread count for export directories (1 measured
        fastest on a shared 2-core CPU, where spinning worker threads fight other processes); an
        engine uses the count its table was measured with."""
        path = Path(path)
        if not is_engine_dir(path):
            backend = OrtBackend(path, intra_op_threads=threads)
            return cls(backend, ModelInfo.from_manifest(backend.manifest), options, cost_model)
        engine = load_engine_dir(path)
        options = options or RuntimeOptions()
        if cost_model is None:
            cost_model = engine.cost_model(options.kv_mode)
        if options.scheduler.confidence_temperatures is None and engine.confidence_temperatures:
            scheduler = replace(options.scheduler, confidence_temperatures=engine.confidence_temperatures)
            options = replace(options, scheduler=scheduler)
        info = ModelInfo.from_manifest(read_manifest(engine.contract_dir, verify="none"))
        return cls(open_backend(engine), info, options, cost_model)

    @classmethod
    def from_checkpoints(cls, target_dir: str | Path, drafter_dir: str | Path,
                         options: RuntimeOptions | None = None, *,
                         cost_model: StepCost | None = None) -> Runtime:
        from dspark.models import load_pair

        from .torch_backend import TorchBackend

        target, drafter = load_pair(target_dir, drafter_dir)
        return cls(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter), options, cost_model)

    def close(self) -> None:
        self.monitor.close()
        self.backend.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def engine(self) -> BatchEngine:
        o = self.options
        capacity = Capacity(o.max_requests, o.max_tokens or o.max_requests * o.max_seq_len, o.max_seq_len)
        return BatchEngine(self.backend, self.info, capacity=capacity, scheduler=o.scheduler,
                      cost_model=self.cost_model, monitor=self.monitor, kv_mode=o.kv_mode)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        stop: Sequence[int] = (),
    ) -> list[RequestResult]:
        """Token-id prompts (one, or a list) -> one result per prompt, in order. Prompt i uses
        seed + i. All prompts are validated before any is queued; a prompt that is not a sequence
        of token ids raises RequestError."""
        batch = _prompt_batch(prompts)
        engine = self.engine()
        ids = [engine.submit(p, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i,
                             stop_token_ids=stop) for i, p in enumerate(batch)]
        finished = engine.run_until_done()
        self.stats = engine.stats
        return [finished[i] for i in ids]

    def stream(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        stop: Sequence[int] = (),
    ) -> Iterator[list[int]]:
        """Yield the newly committed tokens of one request after every step (cut at max_new_tokens
        and at a stop token exactly as `generate` cuts them)."""
        engine = self.engine()
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


def _prompt_batch(prompts: object) -> list[list[int]]:
    """One prompt (a sequence of ids) or a sequence of prompts -> a list of id lists."""
    prompts = as_list(prompts)
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or not prompts:
        raise RequestError(f"prompts must be a sequence of token ids or a list of them, got {prompts!r:.80}")
    if all(not isinstance(p, Sequence) or isinstance(p, str | bytes) for p in prompts):
        return [token_ids(prompts)]
    return [token_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
