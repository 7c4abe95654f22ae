"""Which backend runs an engine directory: engine.json names it, this module opens it.

    backend = open_backend(load_engine_dir("out/engine"))   # opened; close() or use `with`

Built-in backends are imported only when an engine asks for them, so an ORT engine never imports
TensorRT. `register_backend` adds or replaces a factory (tests use it for a fake backend).
A backend that cannot be opened here raises BackendUnavailable with one line saying why.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from dspark.export.engine_dir import EngineDir

from .backend import Backend, BackendUnavailable

BackendFactory = Callable[[EngineDir], Backend]

# engine.json backend name -> (module, class with a `for_engine(EngineDir)` constructor)
_BUILT_IN = {
    "onnxruntime": ("dspark.runtime.ort_backend", "OrtBackend"),
    "tensorrt": ("dspark.runtime.trt_backend", "TrtBackend"),
}
_registered: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory | None) -> None:
    """Use `factory` for engines whose engine.json names `name` (None restores the built-in one)."""
    if factory is None:
        _registered.pop(name, None)
    else:
        _registered[name] = factory


def backend_factory(name: str) -> BackendFactory:
    if name in _registered:
        return _registered[name]
    if name not in _BUILT_IN:
        known = sorted({*_BUILT_IN, *_registered})
        raise BackendUnavailable(f"engine backend '{name}' is unknown here (known: {known})")
    module, cls = _BUILT_IN[name]
    return getattr(importlib.import_module(module), cls).for_engine


def open_backend(engine: EngineDir) -> Backend:
    """The engine's own backend, opened (its sessions or plans loaded)."""
    return backend_factory(engine.backend)(engine).open()
