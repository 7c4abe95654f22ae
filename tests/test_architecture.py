"""The layering of ../shared/ARCHITECTURE.md, checked on the source: arrows point down only
(tools → engines → runtime → export → models, plugins), so no folder imports one above it and no
two folders import each other; the serving path imports neither the exporter nor the yardsticks."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Higher layers may import lower ones; models and plugins share the bottom layer.
LAYER = {"tools": 4, "engines": 3, "runtime": 2, "export": 1, "models": 0, "plugins": 0}
SERVING = ("api", "batch_loop", "backend", "backend_registry", "ort_backend", "trt_backend", "kv_cache",
           "step_batch", "target_runner", "drafter_runner", "chain_verifier", "proposer", "prefix_scheduler",
           "rejection", "sampling", "requests", "stats", "trt_flavours", "kv_tiers", "recovery.framing",
           "recovery.journal", "recovery.recorder", "recovery.resume", "recovery.service_journal", "recovery.snapshot",
           "recovery.engine_state", "request_state")


def dspark_imports(path: Path) -> set[str]:
    """Absolute `dspark.x.y` modules a file imports (relative imports resolved), at any depth."""
    package = ["dspark", *path.relative_to(ROOT).with_suffix("").parts[:-1]]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dspark")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module.startswith("dspark"):
                found.add(module)
                found |= {f"{module}.{a.name}" for a in node.names}
    return found


def folder_edges() -> dict[tuple[str, str], list[str]]:
    """(importing folder, imported folder) -> files, across the package folders."""
    edges: dict[tuple[str, str], list[str]] = {}
    for folder in LAYER:
        for path in (ROOT / folder).rglob("*.py"):
            for module in dspark_imports(path):
                parts = module.split(".")
                if len(parts) > 1 and parts[1] in LAYER and parts[1] != folder:
                    edges.setdefault((folder, parts[1]), []).append(str(path.relative_to(ROOT)))
    return edges


def test_no_folder_imports_a_higher_layer():
    upward = {f"{a} -> {b}": sorted(set(files)) for (a, b), files in folder_edges().items() if LAYER[b] >= LAYER[a]}
    assert not upward, f"imports that point up or sideways: {upward}"


def test_no_import_cycle_between_folders():
    edges = folder_edges()
    cycles = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges)
    assert not cycles


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check above must be able to fail: an upward import in a file is found."""
    probe = ROOT / "runtime" / "_architecture_probe.py"
    probe.write_text("from dspark.engines import build\n", encoding="utf-8")
    try:
        assert ("runtime", "engines") in folder_edges()
    finally:
        probe.unlink()


@pytest.mark.parametrize("module", [f"dspark.runtime.{name}" for name in SERVING])
def test_serving_modules_skip_the_yardsticks(module):
    path = ROOT / Path(*module.split(".")[1:]).with_suffix(".py")
    imported = dspark_imports(path)
    assert not {m for m in imported if m.startswith(("dspark.runtime.reference_decoder",
                                                     "dspark.runtime.tree_decoder"))}


def test_importing_the_runtime_pulls_in_no_exporter_engines_or_tools():
    code = ("import sys, dspark.runtime.api, dspark.runtime.batch_loop, dspark.runtime.backend_registry; "
            "print('\\n'.join(sorted(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    ours = ("dspark.engines", "dspark.tools", "dspark.export.pipeline", "dspark.export.lower",
            "dspark.export.parity", "dspark.export.feeds", "dspark.runtime.reference_decoder",
            "dspark.runtime.tree_decoder")
    theirs = {"onnx", "onnxscript", "tensorrt"}  # onnxruntime is the runtime's own backend
    assert not [m for m in loaded if m.split(".")[0] in theirs or m.startswith(ours)]
