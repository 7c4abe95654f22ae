"""No row verifies drafts past its token budget: a request n tokens short of max_new_tokens keeps at most n of a
step's tokens, so Algorithm 1 sees survival 0 past its (n − 1)-th draft; greedy output stays the target's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_drafting_gate import CHEAP
from test_drafting_gate_engine import engine_for, greedy, prompts

from dspark.runtime.request_state import within_budget

pytestmark = pytest.mark.usefixtures("one_thread")


def rows_left(*left: int, budget: int = 20) -> list[SimpleNamespace]:
    return [SimpleNamespace(max_new_tokens=budget, result=SimpleNamespace(tokens=[0] * (budget - n))) for n in left]


def test_survivals_past_a_rows_budget_are_zero_and_the_rest_untouched():
    survivals = np.linspace(0.9, 0.3, 7)[None, :].repeat(4, axis=0)
    capped = within_budget(survivals, rows_left(1, 3, 7, 30))
    assert capped[0].tolist() == [0.0] * 7  # one token left: the anchor's verification yields it
    assert (capped[1, :2] == survivals[1, :2]).all() and not capped[1, 2:].any()  # 3 left: 2 drafts
    assert (capped[2, :6] == survivals[2, :6]).all() and not capped[2, 6:].any()
    assert (capped[3] == survivals[3]).all()  # far from its end
    assert (survivals > 0).all()  # the caller's survivals (the gate's pool reads them) are left alone
    kept = survivals[:2]
    assert within_budget(kept, rows_left(8, 30)) is kept  # nobody near its end: no copy


BUDGETS = [2, 3, 5, 9]


def past_budget(token_budget: bool) -> int:
    """Drafts verified past what their request could keep, over requests of `BUDGETS` tokens one at a time;
    greedy output checked against the target's."""
    engine, _ = engine_for(CHEAP, slots=1, token_budget=token_budget)  # drafting pays: rows verify all γ drafts
    chosen = prompts()[: len(BUDGETS)]
    ids = [engine.submit(list(p), max_new_tokens=n) for p, n in zip(chosen, BUDGETS, strict=True)]
    results = engine.run_until_done()
    past = 0
    for request_id, prompt, budget in zip(ids, chosen, BUDGETS, strict=True):
        result = results[request_id]
        assert result.tokens == greedy(prompt, budget)
        had = 1  # the prefill's token, before its admission step decodes
        for verified, kept in zip(result.proposal_lengths, result.acceptance_lengths, strict=True):
            past += max(verified - (budget - had - 1), 0)
            had += kept
    assert max(max(s.lengths) for s in engine.stats.steps if s.requests) > 0  # drafts were verified
    return past


def test_the_engine_verifies_no_draft_past_a_requests_budget_and_stays_the_targets():
    assert past_budget(True) == 0
    assert past_budget(False) > 0  # control: without the budget, last steps verify drafts nobody can keep
