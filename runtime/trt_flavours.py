"""The two TensorRT flavours dspark builds and serves, and everything that differs between them.

One builder (engines/trt_builder.py) and one backend (runtime/trt_backend.py) serve both; they ask
the flavour, never the flavour's name, what to do:

                        tensorrt (TensorRT >= 10)        tensorrt-rtx (TensorRT for RTX >= 1)
    module              tensorrt                         tensorrt_rtx
    extra               dspark[tensorrt]                 dspark[tensorrt-rtx]
    compute caps        the build GPU's own              chosen: 7.5, 8.0, 8.6, 8.9, 12.0, 12.1
    build needs a GPU   yes (tactics are timed on it)    no: ahead of time, on a CPU-only machine
    timing cache        timing.cache in the engine dir   none (a no-op in TensorRT-RTX)
    runtime cache       none                             runtime_cache/<graph>.cache: kernels
                                                         JIT-compiled on the GPU at first run,
                                                         kept for the next
    plugin library      libdspark_plugins_trt.so         none (tree masks are graph inputs)

The module is imported by `import_flavour`, lazily, so dspark imports without either.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from .backend import BackendUnavailable


class TensorRTUnavailable(BackendUnavailable):
    """The flavour's TensorRT module (or a helper it needs) cannot be imported, or is too old."""


@dataclass(frozen=True)
class TrtFlavour:
    name: str  # --backend and engine.json tensorrt.flavour
    module: str  # what `import` loads
    title: str  # for messages
    extra: str  # pip extra that installs it
    min_major: int
    # Compute capabilities a build may target ("8.9"); empty: the builder targets the GPU it runs on.
    selectable_ccs: tuple[str, ...]
    default_ccs: tuple[str, ...]
    ahead_of_time: bool  # builds without a GPU: no SPS profiling or TRT-vs-ORT run at build time
    timing_cache: str | None  # engine-dir file of tactic timings reused by rebuilds
    runtime_cache: str | None  # engine-dir folder of kernels compiled at run time (one file per plan)
    plugin_library: bool  # load libdspark_plugins_trt.so before parsing
    needs: str  # what the flavour needs to build, for the install message

    @property
    def install_hint(self) -> str:
        return f'{self.title} is not installed: pip install "dspark[{self.extra}]" ({self.needs})'


TENSORRT = TrtFlavour(
    name="tensorrt", module="tensorrt", title="TensorRT", extra="tensorrt", min_major=10,
    selectable_ccs=(), default_ccs=(), ahead_of_time=False, timing_cache="timing.cache", runtime_cache=None,
    plugin_library=True, needs="needs an NVIDIA GPU with its driver; or build with --backend onnxruntime",
)
TENSORRT_RTX = TrtFlavour(
    name="tensorrt-rtx", module="tensorrt_rtx", title="TensorRT-RTX", extra="tensorrt-rtx", min_major=1,
    selectable_ccs=("7.5", "8.0", "8.6", "8.9", "12.0", "12.1"), default_ccs=("8.0", "8.6", "8.9", "12.0", "12.1"),
    ahead_of_time=True, timing_cache=None, runtime_cache="runtime_cache", plugin_library=False,
    needs="builds on any machine, no GPU needed; its engines run on RTX-class GPUs",
)
FLAVOURS = {f.name: f for f in (TENSORRT, TENSORRT_RTX)}


def flavour_named(name: str) -> TrtFlavour:
    if name not in FLAVOURS:
        raise TensorRTUnavailable(f"TensorRT flavour {name!r} is not one of {sorted(FLAVOURS)}")
    return FLAVOURS[name]


def import_flavour(flavour: TrtFlavour) -> Any:
    """The flavour's module, or TensorRTUnavailable with the one line that says what to install."""
    try:
        trt = importlib.import_module(flavour.module)
    except ImportError:
        raise TensorRTUnavailable(flavour.install_hint) from None
    if int(trt.__version__.split(".")[0]) < flavour.min_major:
        raise TensorRTUnavailable(f"{flavour.title} {trt.__version__} is too old: dspark needs "
                                  f'{flavour.title} >= {flavour.min_major} (pip install -U "dspark[{flavour.extra}]")')
    return trt
