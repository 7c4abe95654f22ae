"""The backend is chosen by engine.json: an engine that names TensorRT is served by the TensorRT
backend (here a fake registered under that name), never by ONNX Runtime on the raw export; a backend
that cannot run here is refused with one line; backends have an open/close lifecycle."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner
from conftest import golden_path

from dspark.export.engine_dir import ENGINE_JSON, FORMAT_VERSION, KIND, EngineDir, validate
from dspark.models import load_pair
from dspark.runtime import backend_registry
from dspark.runtime.api import Runtime
from dspark.runtime.backend import BackendError, BackendUnavailable, WrappedBackend
from dspark.runtime.reference_decoder import autoregressive_generate
from dspark.runtime.torch_backend import TorchBackend

SET = "qwen3-tiny-vanilla"


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    from dspark.export.pipeline import export_pair

    out = tmp_path_factory.mktemp("export")
    export_pair(golden_path(SET, "target"), golden_path(SET, "drafter"), out, check=False, show_progress=False)
    return out


def tensorrt_engine(root, export_dir):
    """A schema-valid engine.json that names the TensorRT backend (plans are placeholders)."""
    root.mkdir()
    (root / "plans").mkdir()
    graphs = {}
    for name in ("target", "drafter_backbone"):
        (root / "plans" / f"{name}.plan").write_bytes(b"plan")
        graphs[name] = {"file": f"plans/{name}.plan", "bytes": 4, "sha256": "0" * 64}
    table = {"batches": [1, 2], "buckets": [1, 8], "verify_seconds": [[1e-3, 2e-3], [None, 3e-3]],
             "draft_seconds": [1e-3, 1.5e-3]}
    manifest = {
        "format_version": FORMAT_VERSION, "kind": KIND, "backend": "tensorrt",
        "export": {"dir": str(export_dir), "manifest_sha256": "0" * 64}, "graphs": graphs,
        "limits": {"max_batch": 2, "max_seq_len": 256, "verify_width": 8, "max_batch_tokens": 8},
        "buckets": [1, 8], "sps": {"tables": {"target": table}}, "calibration": None,
        "built_with": {}, "build_seconds": 0.0,
    }
    (root / ENGINE_JSON).write_text(json.dumps(validate(manifest)), encoding="utf-8")
    return root


class FakeTensorRT(WrappedBackend):
    """Stands in for the TensorRT runner: records what it was opened on, runs the PyTorch graphs."""

    def __init__(self, engine: EngineDir) -> None:
        target, drafter = load_pair(golden_path(SET, "target"), golden_path(SET, "drafter"))
        super().__init__(TorchBackend(target, drafter))
        self.engine = engine
        self.events: list[str] = []

    def _open(self) -> None:
        self.events.append("open")
        super()._open()

    def _close(self) -> None:
        self.events.append("close")

    def _run(self, graph, feeds):
        self.events.append(graph)
        return self.inner.run(graph, feeds)


@pytest.fixture
def fake_tensorrt():
    created: list[FakeTensorRT] = []

    def factory(engine: EngineDir) -> FakeTensorRT:
        created.append(FakeTensorRT(engine))
        return created[-1]

    backend_registry.register_backend("tensorrt", factory)
    yield created
    backend_registry.register_backend("tensorrt", None)


def test_a_tensorrt_engine_is_served_by_the_tensorrt_backend(tmp_path, export_dir, fake_tensorrt):
    engine = tensorrt_engine(tmp_path / "engine", export_dir)
    prompt = [67, 24, 319, 84, 473, 74, 431]
    with Runtime.load(engine) as runtime:
        (backend,) = fake_tensorrt
        assert runtime.backend is backend and backend.is_open
        assert backend.engine.path == engine and backend.engine.backend == "tensorrt"
        result = runtime.generate(prompt, max_new_tokens=16)[0]
        assert runtime.cost_model.to_dict() == json.loads((engine / ENGINE_JSON).read_text())["sps"]["tables"]["target"]
    assert backend.events[0] == "open" and backend.events[-1] == "close" and "target" in backend.events
    target, _ = load_pair(golden_path(SET, "target"), golden_path(SET, "drafter"))
    assert result.tokens == autoregressive_generate(target, prompt, max_new_tokens=16)


def test_a_backend_that_cannot_run_here_is_refused_in_one_line(tmp_path, export_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` fails, as on a machine without it
    engine = tensorrt_engine(tmp_path / "engine", export_dir)
    with pytest.raises(BackendUnavailable, match=r'TensorRT is not installed: pip install "dspark\[tensorrt\]"'):
        Runtime.load(engine)
    from dspark.tools.cli import main

    result = CliRunner().invoke(main, ["generate", "--engine", str(engine), "--prompt-ids", "1,2,3"])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "TensorRT is not installed" in result.output
    assert "Traceback" not in result.output


def test_unknown_backend_names_are_refused():
    with pytest.raises(BackendUnavailable, match="engine backend 'tpu' is unknown"):
        backend_registry.backend_factory("tpu")


def test_lifecycle_closed_backends_refuse_to_run():
    target, drafter = load_pair(golden_path(SET, "target"), golden_path(SET, "drafter"))
    backend = TorchBackend(target, drafter)
    feeds = {"hidden": None}
    with pytest.raises(BackendError, match="not open"):
        backend.run("drafter_head_step", feeds)
    with backend:
        assert backend.is_open
    assert not backend.is_open


def test_ort_backend_opens_every_session_and_closes_them(export_dir):
    from dspark.runtime.ort_backend import OrtBackend

    backend = OrtBackend(export_dir, intra_op_threads=1)
    assert not backend._sessions
    with backend:
        assert set(backend._sessions) == set(backend.specs)
    assert not backend._sessions


def test_tensorrt_engine_serves_through_the_tensorrt_runner(tmp_path, export_dir):
    """Where TensorRT and a GPU exist: a real TensorRT engine decodes the golden greedy trace."""
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install 'dspark[tensorrt]' on a GPU box)")
    pytest.importorskip("polygraphy", reason="Polygraphy is not installed (pip install 'dspark[tensorrt]')")
    from dspark.engines import build as B
    from dspark.engines.trt_builder import plugin_library_path
    from dspark.runtime.trt_backend import TrtBackend

    if not plugin_library_path().is_file():
        pytest.skip(f"{plugin_library_path()} not built (run plugins/build.sh with TensorRT headers)")
    B.build_engine(export_dir, tmp_path / "engine", B.BuildOptions(backend="tensorrt", buckets=(1, 8, 32),
                                                                 max_batch_tokens=32, max_batch=4, max_seq_len=128,
                                                                 warmup=1, repeats=2))
    sample = json.loads(golden_path(SET, "traces.json").read_text())["samples"][0]
    with Runtime.load(tmp_path / "engine") as runtime:
        assert isinstance(runtime.backend, TrtBackend)
        tokens = runtime.generate(sample["prompt_ids"], max_new_tokens=32)[0].tokens
    assert tokens == sample["generated_ids"][:32]


def test_a_thread_count_given_at_load_replaces_an_ort_engines_own(tmp_path, export_dir, fake_tensorrt):
    from dspark.engines.build import BuildOptions, build_engine
    from dspark.runtime.ort_backend import OrtBackend

    engine = tmp_path / "ort-engine"
    build_engine(export_dir, engine, BuildOptions(max_batch=2, max_batch_tokens=8, max_seq_len=64, repeats=1,
                                                  threads=1))
    counts = {}
    for threads in (None, 1, 2):
        with Runtime.load(engine, threads=threads) as runtime:
            assert isinstance(runtime.backend, OrtBackend) and runtime.backend.is_open
            counts[threads] = runtime.backend.options.intra_op_num_threads
            tokens = runtime.generate([67, 24, 319], max_new_tokens=8)[0].tokens
            assert tokens == counts.setdefault("tokens", tokens)  # the same tokens at any count
    assert (counts[None], counts[1], counts[2]) == (1, 1, 2)
    trt = tensorrt_engine(tmp_path / "trt-engine", export_dir)
    with pytest.raises(ValueError, match="thread count applies to ONNX Runtime engines; .* runs on tensorrt"):
        Runtime.load(trt, threads=2)
    assert not fake_tensorrt  # refused before any backend opened
