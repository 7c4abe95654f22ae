"""Public request APIs refuse wrong types with the same error as wrong values (RequestError, one
clear line), before any request is queued."""

from __future__ import annotations

import pytest
from conftest import golden_path

from dspark.runtime.api import Runtime
from dspark.runtime.requests import RequestError, truncate_at_stop


@pytest.fixture(scope="module")
def runtime():
    root = golden_path("qwen3-tiny-vanilla")
    from dspark.runtime.cost_model import StepCostModel

    return Runtime.from_checkpoints(root / "target", root / "drafter", cost_model=StepCostModel(1e-3, 1e-4, 1e-4))


@pytest.mark.parametrize(("prompts", "kwargs", "message"), [
    ([1.5, 2], {}, r"prompt holds 1.5 \(float\), not an integer token id"),
    ("hello", {}, "prompts must be a sequence of token ids"),
    ([], {}, "prompts must be a sequence of token ids"),
    ([[1, 2], [3, "x"]], {}, r"prompt 1 holds 'x' \(str\)"),
    ([1, True], {}, "holds a bool"),
    ([1, 2], dict(max_new_tokens="5"), "max_new_tokens must be an integer"),
    ([1, 2], dict(temperature="hot"), "temperature must be a number"),
    ([1, 2], dict(temperature=float("inf")), "temperature must be a finite number"),
    ([1, 2], dict(stop=[1.5]), r"stop holds 1.5"),
    ([1, 2], dict(stop=[10**6]), r"stop token ids must lie in"),
])
def test_wrong_types_and_values_raise_request_error(runtime, prompts, kwargs, message):
    with pytest.raises(RequestError, match=message):
        runtime.generate(prompts, **{"max_new_tokens": 4, **kwargs})


def test_numpy_and_tuple_prompts_are_token_ids(runtime):
    import numpy as np

    a = runtime.generate(np.array([5, 6, 7]), max_new_tokens=4)[0].tokens
    b = runtime.generate((5, 6, 7), max_new_tokens=4)[0].tokens
    assert a == b and len(a) == 4


def test_truncate_at_stop_reasons():
    assert truncate_at_stop([1, 2, 3, 4], {3}, 10) == ([1, 2, 3], "stop")
    assert truncate_at_stop([1, 2, 3, 4], {3}, 2) == ([1, 2], "length")
    assert truncate_at_stop([1, 2, 3, 4], {9}, 3) == ([1, 2, 3], "length")
