"""The bonus token drawn after a FULLY accepted block follows the target's next distribution p_k
(not the draft distribution q, nor p at the last draft position, nor a residual).

Unit level: `verify_chain` on hand-made rows where drafts are accepted ~90 % of the time; the
bonus after full acceptance must follow p_k (chi-square), and so must the first and second
emitted tokens follow p_0 and p_1. End to end: the batched engine verifying one draft per step,
where the third generated token is that bonus whenever the draft was accepted; the joint law of
(t2, t3) must be the target's, enumerated exactly. Each test carries its negative control: the
same statistic with the bonus redrawn from a wrong distribution must fail.
"""

from __future__ import annotations

import pytest
import torch
from sampling_law import engine_runs, exact_law_of_tokens_2_and_3, pooled_pvalue, small_pair

from dspark.runtime import chain_verifier, rejection
from dspark.runtime.rejection import ChainVerdict

pytestmark = pytest.mark.usefixtures("one_thread")


# p_0, p_1 at the two draft positions and p_2 after them (the bonus row); q close to p where drafted
P = torch.tensor([[0.50, 0.20, 0.10, 0.10, 0.10],
                  [0.10, 0.60, 0.10, 0.10, 0.10],
                  [0.05, 0.05, 0.10, 0.20, 0.60]], dtype=torch.float64)
Q = torch.tensor([[0.45, 0.25, 0.10, 0.10, 0.10],
                  [0.15, 0.55, 0.10, 0.10, 0.10]], dtype=torch.float64)
K, V, RUNS = 2, 5, 4000


def run_chains(verify) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RUNS rounds with drafts drawn from Q -> counts of the 1st emitted token, of the 2nd emitted token
    (rounds whose 1st draft was accepted), and of the bonus after a fully accepted block."""
    drafts_gen, verify_gen = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    first, second, bonus = torch.zeros(V), torch.zeros(V), torch.zeros(V)
    for _ in range(RUNS):
        drafts = torch.multinomial(Q, 1, generator=drafts_gen).flatten()
        verdict = verify(target_logits=P.log().float(), draft_tokens=drafts, draft_logits=Q.log().float(),
                         temperature=1.0, generator=verify_gen)
        emitted = [*drafts[: verdict.accepted_drafts].tolist(), verdict.bonus]
        first[emitted[0]] += 1
        if verdict.accepted_drafts >= 1:
            second[emitted[1]] += 1
        if verdict.accepted_drafts == K:
            bonus[verdict.bonus] += 1
    return first, second, bonus


def bonus_from(wrong_row):
    """verify_chain, but the bonus after a full block redrawn from wrong_row(p, q) (a negative control)."""
    def verify(**kwargs):
        verdict = rejection.verify_chain(**kwargs)
        k = kwargs["draft_tokens"].shape[0]
        if k == 0 or verdict.accepted_drafts < k:
            return verdict
        p, q = (torch.softmax(kwargs[name].float() / kwargs["temperature"], -1)
                for name in ("target_logits", "draft_logits"))
        return ChainVerdict(k, int(torch.multinomial(wrong_row(p, q), 1, generator=kwargs["generator"])))
    return verify


def test_bonus_after_a_full_block_follows_the_target_row_after_it():
    first, second, bonus = run_chains(rejection.verify_chain)
    assert bonus.sum() > 0.8 * RUNS  # the full-acceptance path is the common one here
    assert pooled_pvalue(bonus, P[K]) > 1e-3
    assert pooled_pvalue(first, P[0]) > 1e-3
    assert pooled_pvalue(second, P[1]) > 1e-3


@pytest.mark.parametrize("wrong_row", [
    lambda p, q: q[-1],  # the last draft distribution
    lambda p, q: p[-2],  # the target row of the last draft position
    lambda p, q: rejection.residual_distribution(p[-1], q[-1]),  # a residual
], ids=["draft-q", "target-row-k-1", "residual"])
def test_a_bonus_from_the_wrong_distribution_is_caught(wrong_row):
    _, _, bonus = run_chains(bonus_from(wrong_row))
    assert pooled_pvalue(bonus, P[K]) < 1e-6


def test_engine_bonus_after_an_accepted_draft_follows_the_target(monkeypatch):
    """γ' = 1: t1 from the prefill, t2 the draft or the residual, t3 the bonus after a full block
    whenever the draft was accepted (else t3 comes from the next step)."""
    target, drafter = small_pair()
    law = exact_law_of_tokens_2_and_3(target, 1.0)
    counts, full = engine_runs(target, drafter, temperature=1.0, requests=1536)
    assert full > 0.3 * 1536  # the bonus-after-full-block path is exercised often
    assert pooled_pvalue(counts, law) > 1e-3

    monkeypatch.setattr(chain_verifier, "verify_chain", bonus_from(lambda p, q: q[-1]))
    wrong, _ = engine_runs(target, drafter, temperature=1.0, requests=1536)
    assert pooled_pvalue(wrong, law) < 1e-6
