"""Algorithm 1 (hardware-aware prefix scheduler), its modes, and losslessness: the paper's
Appendix A counterexample (early stop keeps the target distribution, a retrospective search
biases it) and a chi-square test of the engine's output under the scheduler, with a
wrong-acceptance-rule negative control."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_pair
from scipy.stats import chisquare

from dspark.runtime import chain_verifier
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import (
    SchedulerConfig,
    SchedulerConfigError,
    prefix_schedule,
    schedule,
    survival,
)
from dspark.runtime.rejection import ChainVerdict, verify_chain
from dspark.runtime.torch_backend import TorchBackend


def table(sps: dict[int, float]):
    """Step seconds from a steps/s table, elementwise over token counts (as cost models are)."""
    return lambda requests, tokens: 1.0 / np.vectorize(sps.__getitem__, otypes=[float])(tokens)


def retrospective_schedule(survival_probs: torch.Tensor, step_seconds) -> tuple[int, ...]:
    """The unsafe variant Appendix A warns about: walk the same greedy path without stopping
    and keep the best Θ seen anywhere (it looks at candidates after a drop)."""
    requests, gamma = survival_probs.shape
    values = survival_probs.tolist()
    pool = [(values[r][j], r, j) for r in range(requests) for j in range(gamma) if values[r][j] > 0]
    candidates = sorted(pool, key=lambda c: (-c[0], c[1], c[2]))
    lengths, tau, tokens = [0] * requests, float(requests), requests
    best, best_lengths = tau / step_seconds(requests, tokens), tuple(lengths)
    for a, r, j in candidates:
        tau, tokens, lengths[r] = tau + a, tokens + 1, j + 1
        if tau / step_seconds(requests, tokens) > best:
            best, best_lengths = tau / step_seconds(requests, tokens), tuple(lengths)
    return best_lengths


def test_algorithm1_admits_by_survival_and_stops_at_first_drop():
    a = torch.tensor([[0.9, 0.5, 0.45], [0.6, 0.1, 0.05]], dtype=torch.float64)
    # Θ along the path: B=2 τ=2 -> (0.9) 2.9 -> (0.6) 3.5 -> (0.5) 4.0 -> (0.45) ...
    sps = {2: 1.0, 3: 0.8, 4: 0.7, 5: 0.5, 6: 0.49, 7: 0.48, 8: 0.47}
    decision = prefix_schedule(a, table(sps))
    # 2.0, 2.32, 2.45, then 4.0*0.5 = 2.0 drops: stop with (1, 1)
    assert decision.lengths == (1, 1)
    assert decision.expected_accepts == pytest.approx(3.5)
    assert decision.expected_throughput == pytest.approx(3.5 * 0.7)
    assert decision.considered == 3
    # A cliff after the drop would pay off; the early stop must not look past it.
    cliff = {**sps, 6: 10.0}
    assert prefix_schedule(a, table(cliff)).lengths == (1, 1)
    assert retrospective_schedule(a, table(cliff)) == (3, 1)


def depth_scan(survival_probs: torch.Tensor, step_seconds) -> tuple[int, ...]:
    """Padded Algorithm 1 one depth at a time: depth d adds every request's d-th survival and R tokens."""
    requests, gamma = survival_probs.shape
    tau, best, depth = float(requests), requests / step_seconds(requests, requests), 0
    for d in range(gamma):
        column = survival_probs[:, d].tolist()
        theta = (tau + sum(column)) / step_seconds(requests, requests * (d + 2))
        if theta <= best or max(column) <= 0:
            break
        tau, best, depth = tau + sum(column), theta, d + 1
    return (depth,) * requests


def test_padded_pricing_admits_whole_depths_as_a_scalar_scan_would():
    g = np.random.default_rng(0)
    cost = lambda r, b: 1e-3 + 2e-4 * r + 3e-4 * np.asarray(b, dtype=float)  # noqa: E731
    chosen = set()
    for _ in range(300):
        rows, gamma = int(g.integers(1, 9)), int(g.integers(1, 8))
        probs = torch.from_numpy(np.cumprod(g.uniform(0.2, 1.0, (rows, gamma)), axis=1))
        decision = prefix_schedule(probs, cost, padded=True)
        assert decision.lengths == depth_scan(probs, cost)
        chosen.add(decision.lengths[0])
    assert len(chosen) > 2  # the scan stops at various depths
    # one sure request among three unsure ones: packed pricing verifies its four drafts at one token
    # each; padded pricing, where every depth costs four tokens, stops after the first
    probs = torch.tensor([[0.99, 0.98, 0.97, 0.96], *[[0.3, 0.1, 0.05, 0.01]] * 3], dtype=torch.float64)
    confidences = torch.logit(torch.cat((probs[:, :1], probs[:, 1:] / probs[:, :-1]), dim=1))

    def decide(**config):
        return schedule(SchedulerConfig(**config), requests=4, block_size=4, confidence_logits=confidences,
                        step_seconds=cost).lengths

    # a cheaper width after a drop is not looked at: the scan stops at the first drop (Appendix A)
    cliff = lambda r, b: np.where(np.asarray(b) <= 2 * r, 1.0, np.where(np.asarray(b) == 3 * r, 10.0, 0.1))  # noqa: E731
    assert prefix_schedule(probs, cliff, padded=True).lengths == (1,) * 4
    assert decide(pricing="packed") == (4, 0, 0, 0)
    assert decide() == decide(pricing="padded") == prefix_schedule(probs, cost, padded=True).lengths == (1,) * 4


def test_survival_is_cumulative_and_calibrated():
    logits = torch.tensor([[0.0, 2.0, -1.0]])
    a = survival(logits)
    expected = torch.sigmoid(logits.double()).cumprod(1)
    assert torch.allclose(a, expected)
    hot = survival(logits, temperatures=(1.0, 2.0, 0.5))
    assert torch.allclose(hot[0, 1], torch.sigmoid(torch.tensor(0.0, dtype=torch.float64))
                          * torch.sigmoid(torch.tensor(1.0, dtype=torch.float64)))


def test_modes_and_config_errors():
    conf = torch.tensor([[3.0, -3.0, 3.0], [3.0, 3.0, 3.0]])
    run = lambda cfg: schedule(cfg, requests=2, block_size=3, confidence_logits=conf,  # noqa: E731
                               step_seconds=lambda r, b: 1.0)
    assert run(SchedulerConfig("off")).lengths == (0, 0)
    assert run(SchedulerConfig("fixed")).lengths == (3, 3)
    assert run(SchedulerConfig("fixed", fixed_length=2)).lengths == (2, 2)
    assert run(SchedulerConfig("threshold", threshold=0.5)).lengths == (1, 3)
    with pytest.raises(SchedulerConfigError, match="unknown"):
        SchedulerConfig("greedy")
    with pytest.raises(SchedulerConfigError, match="confidence head"):
        schedule(SchedulerConfig("dspark"), requests=1, block_size=3, confidence_logits=None,
                 step_seconds=lambda r, b: 1.0)


# -- Appendix A --------------------------------------------------------------------------------
P_TARGET = torch.tensor([0.7, 0.3])  # tokens A, B
P_DRAFT = torch.tensor([0.5, 0.5])
A1 = 0.8  # = Σ min(p_t, p_d)


def first_token_counts(scheduler, sps: dict[int, float], n: int, seed: int) -> torch.Tensor:
    """Simulate the first output token of Appendix A's γ = 2 request `n` times."""
    g = torch.Generator().manual_seed(seed)
    target_logits = P_TARGET.log().expand(3, 2)  # same next-token distribution at every position
    draft_logits = P_DRAFT.log().expand(2, 2)
    counts = torch.zeros(2)
    for _ in range(n):
        x1 = int(torch.multinomial(P_DRAFT, 1, generator=g))
        x2 = int(torch.multinomial(P_DRAFT, 1, generator=g))
        c2 = 0.9 if x1 == 0 else 0.0  # the Markov confidence of slot 2 depends on x1
        probs = torch.tensor([[A1, A1 * c2]], dtype=torch.float64)
        (k,) = scheduler(probs, table(sps))
        verdict: ChainVerdict = verify_chain(
            target_logits=target_logits[: k + 1], draft_tokens=torch.tensor([x1, x2][:k]),
            draft_logits=draft_logits[:k], temperature=1.0, generator=g,
        )
        counts[x1 if verdict.accepted_drafts >= 1 else verdict.bonus] += 1
    return counts


def causal(probs, step_seconds):
    return prefix_schedule(probs, step_seconds).lengths


PAPER_SPS = {1: 1.0, 2: 0.5, 3: 0.45}


@pytest.mark.parametrize("sps", [PAPER_SPS, {1: 1.0, 2: 0.6, 3: 0.45}], ids=["stops-at-0", "admits-x1"])
def test_appendix_a_early_stop_keeps_the_target_distribution(sps):
    counts = first_token_counts(causal, sps, 1500, seed=0)
    assert chisquare(counts, 1500 * P_TARGET).pvalue > 1e-3


def test_appendix_a_retrospective_search_is_biased():
    counts = first_token_counts(retrospective_schedule, PAPER_SPS, 1500, seed=0)
    assert chisquare(counts, 1500 * P_TARGET).pvalue < 1e-9
    assert counts[0] / 1500 == pytest.approx(0.85, abs=0.03)  # the paper's (0.85, 0.15)


# -- the engine under the scheduler --------------------------------------------------------------
def exact_second_token(target, prompt: list[int]) -> torch.Tensor:
    """P(2nd generated token) at temperature 1 = Σ_t1 p(t1 | prompt) p(t2 | prompt, t1)."""
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt]), torch.arange(len(prompt))[None]).logits[0, -1], -1)
        vocab = p1.shape[0]
        ids = torch.cat((torch.tensor(prompt).expand(vocab, -1), torch.arange(vocab)[:, None]), dim=1)
        p2 = torch.softmax(target(ids, torch.arange(len(prompt) + 1).expand(vocab, -1)).logits[:, -1], -1)
    return (p1.double() @ p2.double()).float()


def engine_second_tokens(target, drafter, prompt, n: int) -> tuple[torch.Tensor, list[int]]:
    engine = BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                    # token_budget off: the second token's law needs drafts verified at a 2-token request's last
                    capacity=Capacity(64, 64 * 32, 32), scheduler=SchedulerConfig("dspark", token_budget=False),
                    cost_model=StepCostModel(1e-3, 1e-3, 1e-5))
    ids = [engine.submit(prompt, max_new_tokens=2, temperature=1.0, seed=s) for s in range(n)]
    finished = engine.run_until_done()
    counts = torch.zeros(target.config.vocab_size)
    for i in ids:
        counts[finished[i].tokens[1]] += 1
    return counts, [k for step in engine.stats.steps for k in step.lengths]


def binned_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected >= 5
    observed = torch.cat((counts[keep], counts[~keep].sum()[None])).double()
    expected = torch.cat((expected[keep], expected[~keep].sum()[None]))
    return chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


def test_engine_is_lossless_under_the_scheduler_and_a_wrong_rule_is_caught(monkeypatch):
    target, drafter = random_pair(11, target_overrides={"vocab_size": 16},
                                  drafter_overrides={"mask_token_id": 15}, scale=40.0)
    prompt = [3, 1, 4, 1, 5]
    probs = exact_second_token(target, prompt)
    n = 640
    counts, lengths = engine_second_tokens(target, drafter, prompt, n)
    assert max(lengths) > 0  # drafts were verified
    assert binned_pvalue(counts, probs) > 1e-3

    def accept_everything(*, target_logits, draft_tokens, draft_logits, temperature, generator):
        k = draft_tokens.shape[0]
        bonus = torch.multinomial(torch.softmax(target_logits[k], -1), 1, generator=generator)
        return ChainVerdict(k, int(bonus))

    monkeypatch.setattr(chain_verifier, "verify_chain", accept_everything)
    wrong, _ = engine_second_tokens(target, drafter, prompt, n)
    assert binned_pvalue(wrong, probs) < 1e-6


# -- ties in survival: each request's admitted slots stay a prefix, τ* is what they add up to -------
def capped(admit: int):
    """step_seconds under which Θ = τ·SPS rises for the first `admit` candidates (a > 0) and drops at
    the next: the step costs 1 s up to B = R + admit verified tokens and 1000 s beyond."""
    return lambda requests, tokens: np.where(np.asarray(tokens) <= requests + admit, 1.0, 1000.0)


def check_prefix_decision(survivals: torch.Tensor, decision, admitted: int) -> None:
    """Algorithm 1 admitted `admitted` candidates: the lengths must verify exactly that many drafts
    (a reversed tie-break admits slot j+1 before slot j and loses or adds one), and τ* must be R plus
    the survival products of the verified prefixes."""
    requests, gamma = survivals.shape
    lengths = decision.lengths
    assert len(lengths) == requests and all(0 <= k <= gamma for k in lengths)
    assert sum(lengths) == admitted, (lengths, admitted)
    for r, k in enumerate(lengths):  # only slots with a > 0 are candidates
        assert all(float(survivals[r, j]) > 0 for j in range(k))
    prefix_sum = sum(float(survivals[r, j]) for r in range(requests) for j in range(lengths[r]))
    assert decision.expected_accepts == pytest.approx(requests + prefix_sum, rel=0, abs=1e-12)


TIES = [
    [[0.5, 0.5, 0.5, 0.2]],  # one request, three tied slots
    [[0.5, 0.5, 0.1, 0.1], [0.5, 0.5, 0.5, 0.0]],  # ties within and across requests, a zero slot
    [[1.0, 1.0, 1.0, 0.9], [0.9, 0.9, 0.3, 0.3], [1.0, 0.25, 0.25, 0.25]],
]


@pytest.mark.parametrize("values", TIES, ids=["one-request", "two-requests", "three-requests"])
def test_tied_survivals_admit_a_prefix_of_each_request(values):
    a = torch.tensor(values, dtype=torch.float64)
    candidates = int((a > 0).sum())
    for admit in range(candidates + 1):
        decision = prefix_schedule(a, capped(admit))
        check_prefix_decision(a, decision, admit)
        tokens = a.shape[0] + sum(decision.lengths)
        assert decision.expected_throughput == pytest.approx(decision.expected_accepts / 1.0)
        assert decision.considered == min(admit + 1, candidates), admit
        assert tokens == a.shape[0] + admit


def test_saturated_confidences_tie_at_one_and_still_admit_a_prefix():
    # σ(40) rounds to 1.0 in float64: the first slots of request 0 all survive with a = 1 exactly.
    conf = torch.tensor([[40.0, 40.0, 40.0, -1.0], [40.0, 0.0, 40.0, 40.0]])
    a = survival(conf)
    assert float(a[0, 0]) == float(a[0, 1]) == float(a[0, 2]) == float(a[1, 0]) == 1.0
    for admit in range(int((a > 0).sum()) + 1):
        decision = schedule(SchedulerConfig("dspark", gate_drafting=False, pricing="packed"), requests=2, block_size=4,
                            confidence_logits=conf, step_seconds=capped(admit))
        check_prefix_decision(a, decision, admit)
    # one admission among four tied a = 1 candidates: slot 1 of request 0 (request, then position)
    assert schedule(SchedulerConfig("dspark", pricing="packed"), requests=2, block_size=4, confidence_logits=conf,
                    step_seconds=capped(1)).lengths == (1, 0)
