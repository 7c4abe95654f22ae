"""Every file of an export dir and of an engine dir, broken four ways (missing, truncated, garbage,
wrong schema), through every command that reads it: each CLI case exits 2 with exactly one line
that names the file and no traceback, and `Runtime.load` raises ArtifactError naming the file.

One small real export and engine of the golden pair are built once; each broken variant is a copy.
`test_the_table_covers_every_file` fails when an export or engine grows a file the table lacks.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import golden_path

from dspark.engines.build import BuildOptions, build_engine
from dspark.export.artifacts import ArtifactError
from dspark.export.pipeline import export_pair
from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.tools.cli import main
from dspark.tools.demo_engine import DEMO_TARGET

SET = "qwen3-tiny-vanilla"
GRAPHS = ("target.onnx", "target_static.onnx", "drafter_backbone.onnx", "drafter_head_step.onnx",
          "drafter_head_greedy.onnx", "target_fused.onnx", "target_fused_tree.onnx", "drafter_backbone_fused.onnx",
          "drafter_draft_greedy_fused.onnx")
# dir kind -> every file in it (relative path)
FILES = {
    "export": ("export.json", *GRAPHS, "tokenizer.json"),
    "engine": ("engine.json", "export.json", *(f"graphs/{g}" for g in GRAPHS), "tokenizer.json"),
}
# another artifact of the same kind in a file's place: valid JSON of another schema, or a valid ONNX
# model of another graph (its size differs from what the manifest records, which is what catches it)
OTHER = {"export.json": "engine/engine.json", "engine.json": "export/export.json",
         "tokenizer.json": "export/export.json", **{g: "export/drafter_head_step.onnx" for g in GRAPHS},
         "drafter_head_step.onnx": "export/drafter_head_greedy.onnx"}
VARIANTS = ("missing", "truncated", "garbage", "wrong_schema")
BUILD = ["--max-batch", "2", "--max-batch-tokens", "8", "--max-seq-len", "64", "--profile-past", "8",
         "--repeats", "1"]
FAST = ["--max-new-tokens", "4", "--scheduler", "fixed", "--gamma", "2"]  # no cost-model profiling


def _cases() -> list[tuple[str, str, str, str]]:
    """(dir kind, file, variant, reader) for every reader of every file."""
    cases = []
    for kind, files in FILES.items():
        for name in files:
            readers = ["generate --prompt"] if name == "tokenizer.json" else (
                ["build-engine"] * (kind == "export") + ["generate", "Runtime.load"])
            cases += [(kind, name, variant, reader) for variant in VARIANTS for reader in readers]
    return cases


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """root/export and root/engine, each with the demo tokenizer.json beside its graphs."""
    root = tmp_path_factory.mktemp("artifacts")
    export_pair(golden_path(SET, "target"), golden_path(SET, "drafter"), root / "export", check=False,
                show_progress=False)
    build_engine(root / "export", root / "engine", BuildOptions(max_batch=2, max_batch_tokens=8, max_seq_len=64,
                                                                profile_past=8, repeats=1, warmup=0))
    for kind in FILES:
        shutil.copyfile(DEMO_TARGET / "tokenizer.json", root / kind / "tokenizer.json")
    return root


@pytest.fixture(scope="module")
def broken(built, tmp_path_factory) -> Callable[[str, str, str], Path]:
    """(kind, file, variant) -> a copy of that dir with that file broken that way (made once)."""
    made: dict[tuple[str, str, str], Path] = {}

    def make(kind: str, name: str, variant: str) -> Path:
        if (kind, name, variant) not in made:
            copy = tmp_path_factory.mktemp(f"{kind}-{variant}") / kind
            shutil.copytree(built / kind, copy)
            path, data = copy / name, (copy / name).read_bytes()
            if variant == "missing":
                path.unlink()
            elif variant == "truncated":
                path.write_bytes(data[: len(data) // 2])
            elif variant == "garbage":  # the recorded size, so size checks pass and the parser must refuse it
                path.write_bytes((b"\xff\xfe\x00garbage" * (len(data) // 10 + 1))[: len(data)])
            else:
                shutil.copyfile(built / OTHER[Path(name).name], path)
            made[kind, name, variant] = copy
        return made[kind, name, variant]

    return make


def test_the_table_covers_every_file(built):
    for kind, files in FILES.items():
        on_disk = {p.relative_to(built / kind).as_posix() for p in (built / kind).rglob("*") if p.is_file()}
        assert on_disk == set(files), f"{kind}: add the new files to FILES (and OTHER)"


def test_the_intact_dirs_load_and_generate(built):
    for kind in FILES:
        result = CliRunner().invoke(main, ["generate", "--engine", str(built / kind), "--prompt-ids", "1,2,3", *FAST])
        assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("kind", "name", "variant", "reader"), _cases(),
                         ids=["-".join(c).replace(" ", "") for c in _cases()])
def test_each_broken_file_is_one_line_naming_it(broken, tmp_path, kind, name, variant, reader):
    folder = broken(kind, name, variant)
    path = str(folder / name)
    if reader == "Runtime.load":
        with pytest.raises(ArtifactError) as caught:
            Runtime.load(folder, RuntimeOptions(scheduler=SchedulerConfig("fixed", fixed_length=2)))
        assert path in str(caught.value) and "\n" not in str(caught.value)
        return
    if reader == "build-engine":
        args = ["build-engine", str(folder), "--out", str(tmp_path / "engine"), *BUILD]
    else:
        prompt = ["--prompt", "def f("] if reader == "generate --prompt" else ["--prompt-ids", "1,2,3"]
        args = ["generate", "--engine", str(folder), *prompt, *FAST]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # not an uncaught exception
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert lines[0].startswith(f"dspark {args[0]}: error: {path}"), lines[0]


def test_the_console_script_prints_one_line_on_stderr(broken, tmp_path):
    """The real entry point, not CliRunner: stderr is the one line, stdout is empty."""
    folder = broken("export", "target.onnx", "garbage")
    script = Path(sys.executable).with_name("dspark-build-engine")
    done = subprocess.run([str(script), str(folder), "--out", str(tmp_path / "engine"), *BUILD],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith(f"dspark-build-engine: error: {folder / 'target.onnx'}")
