"""The `dspark` command line: help, the export/build-engine aliases, the one-line error policy,
unbuilt commands, and `dspark generate` end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner
from conftest import golden_path

from dspark.models import TargetModel
from dspark.runtime.reference_decoder import autoregressive_generate
from dspark.tools.cli import _COMMANDS, main


def _one_line_error(result, prog: str, *fragments: str) -> str:
    """The policy: exit 2, exactly one line `<prog>: error: ...`, no traceback."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


def test_help_lists_every_command():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in _COMMANDS:
        assert name in result.output


def test_help_imports_no_command_module():
    """`dspark --help` lists the commands from cli.py alone: no command module, no torch."""
    code = ("import sys; from click.testing import CliRunner; from dspark.tools.cli import main; "
            "assert CliRunner().invoke(main, ['--help']).exit_code == 0; "
            "print(sorted(m for m in sys.modules if m.endswith('_command') or m == 'torch'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_export_and_build_engine_are_the_console_scripts_commands(monkeypatch, capsys):
    from dspark.tools import cli
    from dspark.tools.build_engine_command import build_engine
    from dspark.tools.export_command import export

    ctx = click.Context(main)
    assert main.get_command(ctx, "export") is export
    assert main.get_command(ctx, "build-engine") is build_engine
    for name, script, entry in (("export", "dspark-export", cli.export_main),
                                ("build-engine", "dspark-build-engine", cli.build_engine_main)):
        via_group = CliRunner().invoke(main, [name, "--help"])
        assert via_group.exit_code == 0 and via_group.output.startswith(f"Usage: dspark {name} ")
        monkeypatch.setattr(sys, "argv", [script, "--help"])
        with pytest.raises(SystemExit) as done:
            entry()
        assert done.value.code == 0
        via_script = capsys.readouterr().out
        assert via_script.startswith(f"Usage: {script} ")
        assert via_script.split("\n", 1)[1].split() == via_group.output.split("\n", 1)[1].split()  # any width


@pytest.mark.parametrize(("args", "listed"), [
    (["export", "--help"], "[float32|float16|bfloat16]"),
    (["build-engine", "--help"], "[onnxruntime|tensorrt|tensorrt-rtx]"),
    (["generate", "--help"], "[dspark|async|fixed|threshold|off]"),
    (["generate", "--help"], "[concat|static]"),
])
def test_fixed_value_options_list_their_choices(args, listed):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and listed in result.output


@pytest.mark.parametrize(("args", "prog", "fragments"), [
    (["export", "--target", "{t}", "--drafter", "{d}", "--out", "{o}", "--dtype", "fp32"], "dspark export",
     ("'--dtype'", "'fp32' is not one of")),
    (["build-engine", "{o}", "--out", "{o}", "--backend", "trt"], "dspark build-engine", ("'trt' is not one of",)),
    (["export", "--target", "{t}", "--drafter", "{d}"], "dspark export", ("Missing option '--out'",)),
    (["generate", "--engine", "{t}", "--prompt-ids", "1,2", "--scheduler", "greedy"], "dspark generate",
     ("'greedy' is not one of",)),
])
def test_a_typo_is_one_line_before_any_work(tmp_path, args, prog, fragments):
    root = golden_path("qwen3-tiny-vanilla")
    out = tmp_path / "out"
    args = [a.format(t=root / "target", d=root / "drafter", o=out) for a in args]
    _one_line_error(CliRunner().invoke(main, args), prog, *fragments)
    assert not out.exists()


def test_user_errors_of_the_console_scripts_name_the_script(tmp_path):
    from dspark.tools.export_command import export

    result = CliRunner().invoke(export, ["--target", str(tmp_path / "nope"), "--drafter", str(tmp_path),
                                         "--out", str(tmp_path / "out")], prog_name="dspark-export")
    _one_line_error(result, "dspark-export", "does not exist")
    result = CliRunner().invoke(main, ["export", "--target", str(tmp_path / "nope"), "--drafter", str(tmp_path),
                                       "--out", str(tmp_path / "out")])
    _one_line_error(result, "dspark export", "does not exist")


@pytest.mark.parametrize("scheduler", ["dspark", "fixed", "off"])
def test_generate_json_equals_target_greedy(scheduler):
    root = golden_path("qwen3-tiny-vanilla")
    prompt = [67, 24, 319, 84, 473, 74, 431]
    result = CliRunner().invoke(main, [
        "generate", "--target", str(root / "target"), "--drafter", str(root / "drafter"),
        "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "24", "--scheduler", scheduler, "--json",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    target = TargetModel.from_pretrained(root / "target")
    assert report["output_ids"] == autoregressive_generate(target, prompt, max_new_tokens=24)
    assert report["tokens_per_second"] > 0 and report["rounds"] >= 1
    if scheduler == "off":
        assert report["mean_accepted_length"] == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "{t}", "--target", "{t}", "--prompt-ids", "1,2"], "not both"),
        (["--target", "{t}", "--prompt-ids", "1,2"], "--target needs --drafter"),
        (["--target", "{t}", "--drafter", "{d}"], "give exactly one of --prompt TEXT or --prompt-ids"),
        (["--target", "{t}", "--drafter", "{d}", "--prompt-ids", "1,x"], "expected comma-separated integers"),
        (["--target", "{t}", "--drafter", "{d}", "--prompt-ids", ""], "expected at least one token id"),
        (["--target", "{t}", "--drafter", "{d}", "--prompt-ids", " , "], "expected at least one token id"),
        (["--target", "{t}", "--drafter", "{d}", "--prompt-ids", "1,9999"], "outside the vocabulary"),
        (["--target", "{t}", "--drafter", "{d}", "--prompt", "hello"], "--prompt needs"),
        (["--engine", "{t}", "--prompt-ids", "1,2", "--device", "cuda"], "--device runs the PyTorch backend"),
        (["--target", "{t}", "--drafter", "{d}", "--prompt-ids", "1,2", "--device", "foo"],
         "expected cpu, cuda or cuda:N"),
    ],
)
def test_generate_refuses_bad_input(args, message):
    root = golden_path("qwen3-tiny-vanilla")
    args = [a.format(t=root / "target", d=root / "drafter") for a in args]
    result = CliRunner().invoke(main, ["generate", *args, "--scheduler", "fixed"])
    _one_line_error(result, "dspark generate", message)


def test_generate_without_engine_builds_the_demo_once_and_reuses_it(tmp_path, monkeypatch):
    from dspark.tools import demo_engine

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    runner = CliRunner()
    first = runner.invoke(main, ["generate", "--prompt", "def parse_args(", "--max-new-tokens", "12", "--json"])
    assert first.exit_code == 0, first.output
    engine = demo_engine.demo_engine_dir(show_progress=False)
    assert (engine / "engine.json").is_file() and (engine / "tokenizer.json").is_file()
    assert engine.parent.parent == tmp_path

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached demo engine must be reused")

    monkeypatch.setattr("dspark.engines.build.build_engine", no_rebuild)
    second = runner.invoke(main, ["generate", "--prompt", "def parse_args(", "--max-new-tokens", "12", "--json"])
    assert second.exit_code == 0, second.output
    report = json.loads(second.output.strip().splitlines()[-1])
    ids = report["output_ids"]
    target = TargetModel.from_pretrained(demo_engine.DEMO_TARGET)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo_engine.DEMO_TARGET / "tokenizer.json"))
    assert report["text"] == tokenizer.decode(ids)
    prompt = tokenizer.encode("def parse_args(").ids
    assert ids == autoregressive_generate(target, prompt, max_new_tokens=12, stop_token_ids=target.config.eos_token_ids)


def test_generate_on_cuda_without_cuda_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: nothing to refuse")
    root = golden_path("qwen3-tiny-vanilla")
    result = CliRunner().invoke(main, ["generate", "--target", str(root / "target"), "--drafter", str(root / "drafter"),
                                       "--prompt-ids", "1,2", "--device", "cuda"])
    _one_line_error(result, "dspark generate", "sees no CUDA device")


@pytest.mark.gpu
def test_generate_on_cuda_equals_the_target_alone_on_cuda():
    """`dspark generate --device cuda` on the bundled demo pair: DSpark's tokens are the target's alone."""
    from importlib import resources

    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"needs a CUDA device: torch {torch.__version__} sees none")
    demo = resources.files("dspark.models") / "demo"
    outputs = []
    for scheduler in ("dspark", "off"):
        result = CliRunner().invoke(main, [
            "generate", "--target", str(demo / "target"), "--drafter", str(demo / "dspark"), "--prompt",
            "def parse_args(", "--max-new-tokens", "32", "--device", "cuda", "--scheduler", scheduler, "--json"])
        assert result.exit_code == 0, result.output
        outputs.append(json.loads(result.output))
    assert outputs[0]["output_ids"] == outputs[1]["output_ids"] and outputs[0]["mean_accepted_length"] > 1
