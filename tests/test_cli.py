"""The `dspark` command line: help, unbuilt commands, and `dspark generate` end to end."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import golden_path

from dspark.models import TargetModel
from dspark.runtime.reference_decoder import autoregressive_generate
from dspark.tools.cli import _NOT_BUILT, main


def test_help_lists_every_command():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in ("generate", *_NOT_BUILT):
        assert name in result.output


@pytest.mark.parametrize("name", sorted(_NOT_BUILT))
def test_unbuilt_commands_say_so_and_exit_2(name):
    result = CliRunner().invoke(main, [name, "--anything"])
    assert result.exit_code == 2
    assert "not built yet" in result.output


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
        (["--target", "{t}", "--drafter", "{d}", "--prompt-ids", "1,9999"], "outside the vocabulary"),
        (["--target", "{t}", "--drafter", "{d}", "--prompt", "hello"], "--prompt needs"),
    ],
)
def test_generate_refuses_bad_input(args, message):
    root = golden_path("qwen3-tiny-vanilla")
    args = [a.format(t=root / "target", d=root / "drafter") for a in args]
    result = CliRunner().invoke(main, ["generate", *args, "--scheduler", "fixed"])
    assert result.exit_code == 2, result.output
    assert message in result.output


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
    ids = json.loads(second.output.strip().splitlines()[-1])["output_ids"]
    target = TargetModel.from_pretrained(demo_engine.DEMO_TARGET)
    from tokenizers import Tokenizer

    prompt = Tokenizer.from_file(str(demo_engine.DEMO_TARGET / "tokenizer.json")).encode("def parse_args(").ids
    assert ids == autoregressive_generate(target, prompt, max_new_tokens=12, stop_token_ids=target.config.eos_token_ids)
