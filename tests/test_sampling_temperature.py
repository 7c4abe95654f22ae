"""Temperature T ≠ 1 samples from softmax(logits / T), checked against a softmax written out in
this file (not dspark.runtime.sampling): the probabilities themselves, token draws (per row, mixed
temperatures), the acceptance rule, and the batched engine end to end (exact enumeration of the
target's law of (t2, t3), chi-square). T = 0.5 and T = 2.0 are each other's mirror under the bug
logits·T (logits·0.5 = logits / 2), so each end-to-end run is also the control: its counts must
be rejected against the law at the other temperature.
"""

from __future__ import annotations

import pytest
import torch
from sampling_law import engine_runs, exact_law_of_tokens_2_and_3, pooled_pvalue, small_pair, softmax_at

from dspark.runtime.rejection import verify_chain
from dspark.runtime.sampling import draw, probabilities, sample_rows, sample_token

TEMPERATURES = (0.5, 2.0)
LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 3.0],
                       [0.0, 0.2, -2.0, 1.5, 1.0, -0.5]])


pytestmark = pytest.mark.usefixtures("one_thread")


def test_softmax_here_is_softmax_of_logits_over_t():
    by_hand = torch.exp(LOGITS[0].double() / 0.5)
    assert torch.allclose(softmax_at(LOGITS[0], 0.5), by_hand / by_hand.sum(), atol=1e-15)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_probabilities_are_softmax_of_logits_over_t(temperature):
    got = probabilities(LOGITS, temperature).double()
    assert torch.allclose(got, softmax_at(LOGITS, temperature), atol=1e-6)
    assert not torch.allclose(got, softmax_at(LOGITS, 1.0 / temperature), atol=1e-3)  # T matters here


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_sample_token_frequencies(temperature):
    n = 20000
    g = torch.Generator().manual_seed(0)
    tokens = sample_token(LOGITS[0].expand(n, -1), temperature, g)
    counts = torch.bincount(tokens, minlength=LOGITS.shape[1]).double()
    assert pooled_pvalue(counts, softmax_at(LOGITS[0], temperature)) > 1e-3
    assert pooled_pvalue(counts, softmax_at(LOGITS[0], 1.0 / temperature)) < 1e-6


def test_sample_rows_uses_each_rows_own_temperature():
    n = 3000
    logits = LOGITS.repeat(n, 1)  # rows alternate LOGITS[0], LOGITS[1]
    temperatures = [0.5, 2.0] * n
    generators = [torch.Generator().manual_seed(i) for i in range(2 * n)]
    tokens = sample_rows(logits, temperatures, generators)
    for row, temperature in enumerate(temperatures[:2]):
        counts = torch.bincount(tokens[row::2], minlength=LOGITS.shape[1]).double()
        assert pooled_pvalue(counts, softmax_at(LOGITS[row], temperature)) > 1e-3
        assert pooled_pvalue(counts, softmax_at(LOGITS[row], 1.0 / temperature)) < 1e-6


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_acceptance_rule_at_temperature(temperature):
    """Drafts drawn from softmax(q / T): the first emitted token follows softmax(p_0 / T) and the bonus
    after a full block softmax(p_2 / T)."""
    target = torch.tensor([[1.0, 0.0, -1.0, 0.5], [0.0, 1.5, 0.2, -1.0], [-1.0, 0.0, 0.5, 1.2]])
    draft = torch.tensor([[0.5, 0.5, -1.0, 0.0], [0.0, 1.0, 0.5, -0.5]])
    q = softmax_at(draft, temperature)
    drafts_gen, verify_gen = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    first, bonus = torch.zeros(4), torch.zeros(4)
    for _ in range(3000):
        drafts = torch.multinomial(q, 1, generator=drafts_gen).flatten()
        verdict = verify_chain(target_logits=target, draft_tokens=drafts, draft_logits=draft,
                               temperature=temperature, generator=verify_gen)
        first[drafts[0] if verdict.accepted_drafts else verdict.bonus] += 1
        if verdict.accepted_drafts == 2:
            bonus[verdict.bonus] += 1
    assert bonus.sum() > 300
    assert pooled_pvalue(first, softmax_at(target[0], temperature)) > 1e-3
    assert pooled_pvalue(bonus, softmax_at(target[2], temperature)) > 1e-3
    assert pooled_pvalue(first, softmax_at(target[0], 1.0 / temperature)) < 1e-6


@pytest.fixture(scope="module")
def pair():
    return small_pair()


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_engine_samples_the_target_law_at_temperature(pair, temperature):
    target, drafter = pair
    counts, full = engine_runs(target, drafter, temperature=temperature, requests=1536)
    assert full > 0  # drafts were accepted and bonus tokens drawn after them
    assert pooled_pvalue(counts, exact_law_of_tokens_2_and_3(target, temperature)) > 1e-3
    # the law logits·T would sample from: caught
    assert pooled_pvalue(counts, exact_law_of_tokens_2_and_3(target, 1.0 / temperature)) < 1e-6


def test_draw_follows_unnormalised_weights_and_never_draws_a_zero_weight():
    weights = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.5, 0.0])  # a residual's shape: zeros where p <= q
    g = torch.Generator().manual_seed(3)
    tokens = draw(weights.expand(20000, -1), g)
    counts = torch.bincount(tokens, minlength=weights.numel()).double()
    assert counts[weights == 0].sum() == 0
    assert pooled_pvalue(counts, weights.double() / weights.sum()) > 1e-3
    assert pooled_pvalue(counts, torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 0.0]).double() / 3) < 1e-6
    assert draw(weights, g).shape == () and draw(torch.ones(2, 3, 4), g).shape == (2, 3)
