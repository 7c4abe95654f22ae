"""tools/engine_tree_bench runs end to end on the golden pair and prints its table (figures are
the bench's business; here: every method and batch size has a row, AR's ratio to itself is 1)."""

from __future__ import annotations

from click.testing import CliRunner
from conftest import golden_path

from dspark.tools.engine_tree_bench import METHODS, main


def test_engine_tree_bench_prints_every_method_and_batch_size() -> None:
    folder = golden_path("qwen3-tiny-vanilla")
    result = CliRunner().invoke(main, ["--target", str(folder / "target"), "--drafter", str(folder / "drafter"),
                                       "--requests", "1,3", "--new-tokens", "6", "--repeats", "1",
                                       "--tree-nodes", "4", "--threads", "1"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines() if line.split()[:1] in (["1"], ["3"])]
    assert [(r[0], r[1]) for r in rows] == [(str(n), m) for n in (1, 3) for m in METHODS]
    assert all(float(r[5]) > 0 for r in rows) and {r[5] for r in rows if r[1] == "autoregressive"} == {"1.00"}


def test_a_cuda_bench_without_cuda_is_one_clear_line() -> None:
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: nothing to refuse")
    folder = golden_path("qwen3-tiny-vanilla")
    result = CliRunner().invoke(main, ["--target", str(folder / "target"), "--drafter", str(folder / "drafter"),
                                       "--device", "cuda", "--requests", "1"])
    assert result.exit_code == 2 and "sees no CUDA device" in result.output and "Traceback" not in result.output
