"""Sequential Temperature Scaling: ECE itself, a synthetic predictor whose true temperature is known,
the reliability diagram, and calibration data files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark.engines.calibration import (
    ece,
    evaluate,
    fit_sts,
    reliability_diagram,
    sigmoid,
    survival_labels,
)
from dspark.engines.calibration_data import read_sequences
from dspark.engines.export_source import BuildError


def test_ece_by_hand():
    # bin [0.2, 0.267): p = 0.2, 0.2 with labels 0, 1 -> |0.5 - 0.2| = 0.3, weight 1/2
    # bin [0.933, 1]: p = 0.95, 0.95 with labels 1, 1 -> |1 - 0.95| = 0.05, weight 1/2
    assert ece(np.array([0.2, 0.2, 0.95, 0.95]), np.array([0, 1, 1, 1])) == pytest.approx(0.175)
    assert ece(np.array([0.0, 1.0]), np.array([0, 1])) == 0.0
    with pytest.raises(ValueError, match="equal non-empty"):
        ece(np.array([0.5]), np.array([1, 0]))


def test_survival_labels():
    assert survival_labels(np.array([0, 2, 3]), 3).tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]


def synthetic_rounds(n: int, gamma: int, true_temperature: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rounds where slot j survives (given the prefix) with probability σ(z_j), but the predictor
    reports the logit z_j · T_j: its calibrating temperature is exactly T_j."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.0, 1.5, size=(n, gamma))
    survive = rng.random((n, gamma)) < sigmoid(z)
    accepted = np.where(survive.all(axis=1), gamma, np.argmin(survive, axis=1))  # first failing slot
    return z * true_temperature[None, :], accepted


@pytest.mark.parametrize("true_t", [3.0, 0.4])  # over- and under-confident
def test_sts_recovers_the_true_temperature_and_lowers_ece(true_t):
    gamma = 5
    truth = np.full(gamma, true_t)
    logits, accepted = synthetic_rounds(20000, gamma, truth, seed=0)
    result = fit_sts(logits, accepted)
    # ECE is noisy in T near its minimum, and later slots see fewer surviving rows: loose bounds
    assert np.allclose(result.temperatures[:3], truth[:3], rtol=0.25), result.temperatures
    assert np.mean(result.ece_after) < 0.3 * np.mean(result.ece_before)
    held = evaluate(result, *synthetic_rounds(5000, gamma, truth, seed=1))
    assert held["ece_after_mean"] < 0.5 * held["ece_before_mean"]


def test_sts_keeps_a_calibrated_predictor_near_one():
    logits, accepted = synthetic_rounds(20000, 4, np.ones(4), seed=2)
    result = fit_sts(logits, accepted)
    assert np.allclose(result.temperatures[:2], 1.0, rtol=0.25), result.temperatures
    assert np.mean(result.ece_before) < 0.03


def test_fit_sts_rejects_bad_rows():
    with pytest.raises(ValueError, match=r"accepted counts must lie in \[0, 2\]"):
        fit_sts(np.zeros((3, 2)), np.array([0, 1, 3]))
    with pytest.raises(ValueError, match="needs"):
        fit_sts(np.zeros((3, 2)), np.array([0, 1]))


def test_reliability_diagram_writes_a_png(tmp_path):
    logits, accepted = synthetic_rounds(2000, 3, np.full(3, 2.0), seed=3)
    result = fit_sts(logits, accepted)
    path = reliability_diagram(tmp_path / "cal.png", logits, accepted, result)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_read_sequences_formats(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"ids": [1, 2]}) + "\n" + json.dumps([3, 4, 5]) + "\n\n")
    assert read_sequences(tmp_path / "a.jsonl") == [[1, 2], [3, 4, 5]]
    (tmp_path / "b.txt").write_text("1 2 3\n4,5\n")
    assert read_sequences(tmp_path / "b.txt") == [[1, 2, 3], [4, 5]]
    (tmp_path / "c.txt").write_text("def f(x):\n")
    with pytest.raises(BuildError, match="tokenizer.json is needed"):
        read_sequences(tmp_path / "c.txt")
    # A text line full of numbers is text, and deciding so is immediate (a nested-quantifier regex
    # used to backtrack exponentially on such lines).
    (tmp_path / "e.txt").write_text("   ".join(str(i) for i in range(60)) + " = table(x)\n")
    with pytest.raises(BuildError, match="tokenizer.json is needed"):
        read_sequences(tmp_path / "e.txt")
    (tmp_path / "d.jsonl").write_text("{oops\n")
    with pytest.raises(BuildError, match=r"d.jsonl:1: not valid JSON"):
        read_sequences(tmp_path / "d.jsonl")
    with pytest.raises(BuildError, match="does not exist"):
        read_sequences(tmp_path / "missing.txt")


def test_read_sequences_text_with_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    assert read_sequences(tmp_path / "t.jsonl", tmp_path / "tokenizer.json") == [[0, 1]]
