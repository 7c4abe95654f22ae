"""The backend interface: run a named graph on named feeds (Polygraphy-style runner).

Lifecycle: construct (cheap, nothing loaded) → `open()` (sessions, plans or modules loaded; bad
files raise ArtifactError here, not mid-decode) → `run(graph, feeds)` any number of times →
`close()`. A backend is also a context manager. `runtime.backend_registry` picks the backend an
engine directory names in engine.json.

Every backend (PyTorch reference, ONNX Runtime, TensorRT) describes its graphs with the
export contract's `GraphSpec`s (`dspark.export.contract`: names, dtypes, dims); `Backend.run`
checks each feed against the spec (names, dtypes, ranks, fixed dims, and one size per symbolic
dim across feeds) before dispatching, and times every call. Feeds and outputs are numpy arrays or
torch tensors; a backend returns what is cheapest for it, and `as_torch` converts.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from dspark.export.contract import GraphSpec

Array = np.ndarray | torch.Tensor
B = TypeVar("B", bound="Backend")

_NUMPY_NAMES = {"int64": "int64", "int32": "int32", "float32": "float32", "float16": "float16",
                "bool": "bool", "bfloat16": "bfloat16"}


class BackendError(RuntimeError):
    """A graph was called with feeds that do not match its metadata, or does not exist."""


class BackendUnavailable(RuntimeError):
    """The backend an engine needs cannot run here (package missing, too old, no device)."""


def dtype_name(value: Array) -> str:
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    return _NUMPY_NAMES.get(value.dtype.name, value.dtype.name)


def check_feeds(spec: GraphSpec, feeds: Mapping[str, Array]) -> None:
    """Raise BackendError naming every missing/unexpected feed and each dtype or shape mismatch."""
    expected = {t.name: t for t in spec.inputs}
    missing = sorted(set(expected) - set(feeds))
    extra = sorted(set(feeds) - set(expected))
    if missing or extra:
        raise BackendError(f"graph '{spec.name}': missing feeds {missing}, unexpected feeds {extra}")
    problems = []
    bound: dict[str, int] = {}
    for name, t in expected.items():
        value = feeds[name]
        if dtype_name(value) != t.dtype:
            problems.append(f"{name}: dtype {dtype_name(value)}, expected {t.dtype}")
            continue
        shape = tuple(value.shape)
        if len(shape) != len(t.dims):
            problems.append(f"{name}: rank {len(shape)} {shape}, expected dims {t.dims}")
            continue
        for got, want in zip(shape, t.dims, strict=True):
            if isinstance(want, int) and got != want:
                problems.append(f"{name}: shape {shape}, expected dims {t.dims}")
                break
            if isinstance(want, str) and bound.setdefault(want, got) != got:
                problems.append(f"{name}: dim '{want}' is {got} here but {bound[want]} in another feed")
                break
    if problems:
        raise BackendError(f"graph '{spec.name}': " + "; ".join(problems))


RECENT_CALLS = 1024  # per graph: a server makes thousands of graph calls a second, for days


@dataclass
class CallTimes:
    """Per graph: how many calls, their total wall-clock seconds, and the last `RECENT_CALLS` of them
    (bounded: every call's time, kept, grew by ~32 bytes a call without end)."""

    seconds: dict[str, deque[float]] = field(default_factory=lambda: defaultdict(lambda: deque(maxlen=RECENT_CALLS)))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, graph: str, seconds: float) -> None:
        self.seconds[graph].append(seconds)
        self.calls[graph] += 1
        self.totals[graph] += seconds

    def total(self, graph: str) -> float:
        return self.totals.get(graph, 0.0)

    def count(self, graph: str) -> int:
        return self.calls.get(graph, 0)


class Backend(ABC):
    """Run named graphs. Subclasses provide `specs` and `_run`, and load what they run in `_open`;
    `run` checks feeds and times every call."""

    def __init__(self) -> None:
        self.times = CallTimes()
        self.check_inputs = True
        self._checked: set[tuple] = set()  # feed layouts (graph, names, shapes, dtypes) already checked
        self._is_open = False

    @property
    def is_open(self) -> bool:
        return self._is_open

    def open(self: B) -> B:
        if not self._is_open:
            self._open()
            self._is_open = True
        return self

    def close(self) -> None:
        if self._is_open:
            self._close()
            self._is_open = False

    def __enter__(self: B) -> B:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _open(self) -> None:
        """Load sessions, plans or modules."""

    @abstractmethod
    def _close(self) -> None:
        """Release what `_open` loaded."""

    @property
    @abstractmethod
    def specs(self) -> dict[str, GraphSpec]: ...

    @property
    def kv_device(self) -> torch.device | None:
        """Where the engine keeps the target's keys/values: None = host numpy buffers; a device =
        tensors there, which this backend takes as feeds and returns its target graphs' new
        keys/values on (so they never cross the bus)."""
        return None

    @abstractmethod
    def _run(self, graph: str, feeds: Mapping[str, Array]) -> dict[str, Array]: ...

    def run(self, graph: str, feeds: Mapping[str, Array]) -> dict[str, Array]:
        self._check(graph, feeds)
        begin = time.perf_counter()
        out = self._run(graph, feeds)
        self.times.add(graph, time.perf_counter() - begin)
        return out

    def run_into(self, graph: str, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """Run `graph` once with its outputs left in preallocated arrays (see `bind`)."""
        self.bind(graph, feeds, outputs).run()

    def bind(self, graph: str, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> BoundCall:
        """Bind `graph` to arrays once; `BoundCall.run()` then runs it on whatever the feed arrays
        hold, leaving the named outputs in the output arrays (C-contiguous, the outputs' shapes and
        dtypes; other outputs are dropped). An array that is both a feed and an output is one buffer
        the graph updates in place (a fused graph's shared past/present K/V). Feeds are checked here,
        once. This base version runs and copies; backends that can bind memory (ONNX Runtime) write
        straight into the arrays."""
        self._check(graph, feeds)
        return BoundCall(graph, lambda: self._copy_into(graph, feeds, outputs), self.times)

    def _copy_into(self, graph: str, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        out = self._run(graph, feeds)
        for name, array in outputs.items():
            np.copyto(array, np.asarray(out[name]))

    def _check(self, graph: str, feeds: Mapping[str, Array]) -> None:
        if not self._is_open:
            raise BackendError(f"{type(self).__name__} is not open: call open() (or use it in a with block) first")
        if graph not in self.specs:
            raise BackendError(f"no graph '{graph}' in this backend (has: {sorted(self.specs)})")
        if self.check_inputs:
            # a decode loop repeats a few dozen feed layouts: each is checked the first time only
            layout = (graph, *((name, value.shape, value.dtype) for name, value in feeds.items()))
            if layout not in self._checked:
                check_feeds(self.specs[graph], feeds)
                if len(self._checked) >= 4096:
                    self._checked.clear()
                self._checked.add(layout)


class BoundCall:
    """One graph bound to its arrays (`Backend.bind`): refill the feed arrays in place, `run()`."""

    def __init__(self, graph: str, call: Callable[[], object], times: CallTimes, holds: object = None) -> None:
        self.graph, self._call, self._times = graph, call, times
        self._holds = holds  # what the binding points into (ORT's OrtValues), alive as long as the call

    def run(self) -> None:
        begin = time.perf_counter()
        self._call()
        self._times.add(self.graph, time.perf_counter() - begin)


def as_torch(value: Array) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))


def as_numpy(value: Array) -> np.ndarray:
    """A host array: a tensor (on any device) is brought back, a numpy array is returned as it is."""
    return value.cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


class WrappedBackend(Backend):
    """A backend in front of another (`inner`): same graphs, every call passed through. Subclasses
    add what they are for (recording, a virtual clock, events) around `_run`. Opening
    it opens `inner`; closing it leaves `inner` to its owner unless `owns_inner`."""

    def __init__(self, inner: Backend, *, owns_inner: bool = False) -> None:
        super().__init__()
        self.inner, self.owns_inner = inner, owns_inner

    @property
    def specs(self) -> dict[str, GraphSpec]:
        return self.inner.specs

    @property
    def kv_device(self) -> torch.device | None:
        return self.inner.kv_device

    def _open(self) -> None:
        self.inner.open()

    def _close(self) -> None:
        if self.owns_inner:
            self.inner.close()

    def _run(self, graph: str, feeds: Mapping[str, Array]) -> dict[str, Array]:
        return self.inner.run(graph, feeds)
