"""CUDA-graph replay of the PyTorch backend's graph modules, one captured graph per feed layout.

On a GPU the eager modules are launch-bound: a decode step of a small-batch target is a few hundred
kernel launches from Python, each a few microseconds, while its memory traffic takes a fraction of
that. A CUDA graph replays all of a call's kernels in one launch. Capturing needs fixed addresses,
so a layout (the bucket) is the graph name plus every feed's shape and dtype, and for the feeds
the caller names in place (the slot cache's rows on the device, bound whole by the static-cache
graph) also their address and strides: those are read where they are. Every other feed (token ids,
positions, masks; host arrays or device tensors) is copied into buffers made at capture.

Replay does not always pay: on the H200 the 1B cost stand-in's target step ran slower replayed than
eager (its skinny fp32 GEMMs, presumably other cuBLAS kernels under capture), while the drafter's
small graphs ran 2-3x faster. So each layout is measured: its first call runs eagerly (warm-up),
the next `trials` eagerly and timed, then it is captured and the next `trials` replays are timed;
it keeps replaying only if its best replay beat its best eager call, else it runs eagerly for
good (as does one whose capture fails). At most `max_graphs` are kept, in one memory pool (calls
run one at a time, so their intermediates can share it).

The outputs are the graph's own buffers: the next replay of the same layout overwrites them, so a
caller must be done with one call's outputs before it makes the next (the engine commits the new
keys/values and reads the logits within the step). `capture=False` keeps that contract without
CUDA, replaying the module eagerly into the same buffers, so the CPU tests exercise the aliasing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

Layout = tuple[Any, ...]


class CapturedCall:
    """One module at one feed layout: static inputs, the captured graph (or an eager stand-in), static outputs."""

    def __init__(self, module: nn.Module, feeds: Sequence[torch.Tensor | np.ndarray], in_place: Sequence[bool],
                 device: torch.device, pool: Any, capture: bool) -> None:
        self._copied = [not keep for keep in in_place]
        self._inputs = [torch.empty(f.shape, dtype=_torch_dtype(f), device=device) if copied else f
                        for f, copied in zip(feeds, self._copied, strict=True)]
        self._load(feeds)
        self._module = module
        self.graph: torch.cuda.CUDAGraph | None = None
        if capture:
            self.graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(device)
            with torch.cuda.graph(self.graph, pool=pool):
                self.outputs = list(module(*self._inputs))
        else:
            self.outputs = [o.clone() for o in module(*self._inputs)]

    def _load(self, feeds: Sequence[torch.Tensor | np.ndarray]) -> None:
        for buf, feed, copied in zip(self._inputs, feeds, self._copied, strict=True):
            if copied:
                buf.copy_(feed if isinstance(feed, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(feed)))

    def run(self, feeds: Sequence[torch.Tensor | np.ndarray]) -> list[torch.Tensor]:
        self._load(feeds)
        if self.graph is not None:
            self.graph.replay()
        else:
            for out, fresh in zip(self.outputs, self._module(*self._inputs), strict=True):
                out.copy_(fresh)
        return self.outputs


class GraphCache:
    """Calls by layout, for modules run on `device`: replayed where that was measured to pay, else eager."""

    def __init__(self, device: torch.device, *, max_graphs: int = 64, capture: bool = True, tune: bool = True,
                 trials: int = 2, clock: Callable[[], float] | None = None) -> None:
        self.device, self.max_graphs, self.capture, self.trials = device, max_graphs, capture, trials
        self.tune = tune  # time `trials` eager calls and `trials` replays of each layout, keep the faster
        self.clock = clock or (lambda: _synchronized_clock(device))
        self.calls: dict[Layout, CapturedCall] = {}
        self.eager_layouts: set[Layout] = set()  # capture failed, or replay measured no faster: eager for good
        self._sightings: dict[Layout, int] = {}
        self._times: dict[Layout, tuple[list[float], list[float]]] = {}  # layout -> (eager, replay) seconds
        self._pool: Any = None

    def run(self, graph: str, module: nn.Module, feeds: Sequence[torch.Tensor | np.ndarray],
            in_place: Sequence[bool]) -> list[torch.Tensor]:
        """`module(*feeds)`, replayed or eager. `in_place[i]`: feed i is read where it is (a tensor on the
        device; its address joins the layout)."""
        in_place = [keep and _on_device(f, self.device) for f, keep in zip(feeds, in_place, strict=True)]
        layout = (graph, *(_layout(f, keep) for f, keep in zip(feeds, in_place, strict=True)))
        call = self.calls.get(layout)
        if call is not None and layout not in self._times:
            return call.run(feeds)
        seen = self._sightings.get(layout, 0)
        if layout in self.eager_layouts or (call is None and len(self.calls) >= self.max_graphs) or (
                not seen and len(self._sightings) >= 16 * self.max_graphs):  # never-recurring layouts: not kept
            return self._eager(module, feeds)
        self._sightings[layout] = seen + 1
        if not seen:  # the first call warms the kernels (cuBLAS handles, autotuning) up
            return self._eager(module, feeds)
        timing = self.tune
        eager, replay = self._times.setdefault(layout, ([], [])) if timing else ([], [])
        if timing and len(eager) < self.trials:
            return self._timed(eager, lambda: self._eager(module, feeds))
        if call is None:
            try:
                call = CapturedCall(module, feeds, in_place, self.device, self._pool, self.capture)
            except RuntimeError:  # an operation that cannot be captured (a host sync)
                self.eager_layouts.add(layout)
                self._times.pop(layout, None)
                return self._eager(module, feeds)
            if call.graph is not None and self._pool is None:
                self._pool = call.graph.pool()
            self.calls[layout] = call
        if not timing:
            return call.run(feeds)
        outputs = self._timed(replay, lambda: call.run(feeds))
        if len(replay) == self.trials:  # decided: replay only where it was faster
            del self._times[layout]
            if min(replay) >= min(eager):
                del self.calls[layout]
                self.eager_layouts.add(layout)
        return outputs

    def _eager(self, module: nn.Module, feeds: Sequence[torch.Tensor | np.ndarray]) -> list[torch.Tensor]:
        return list(module(*(_as_tensor(f).to(self.device) for f in feeds)))

    def _timed(self, into: list[float], call: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        begin = self.clock()
        outputs = call()
        into.append(self.clock() - begin)
        return outputs


def _synchronized_clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _as_tensor(feed: torch.Tensor | np.ndarray) -> torch.Tensor:
    return feed if isinstance(feed, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(feed))


def _on_device(feed: torch.Tensor | np.ndarray, device: torch.device) -> bool:
    return (isinstance(feed, torch.Tensor) and feed.device.type == device.type
            and (device.index is None or feed.device.index == device.index))


def _layout(feed: torch.Tensor | np.ndarray, in_place: bool) -> tuple[Any, ...]:
    if in_place:  # its address is part of the graph
        return ("device", tuple(feed.shape), feed.dtype, feed.data_ptr(), feed.stride())
    return ("copied", tuple(feed.shape), str(feed.dtype))


def _torch_dtype(feed: torch.Tensor | np.ndarray) -> torch.dtype:
    return feed.dtype if isinstance(feed, torch.Tensor) else torch.from_numpy(np.zeros(0, feed.dtype)).dtype
