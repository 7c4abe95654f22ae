"""The asynchronous prefix scheduler (paper §5.2, scheduler mode `async`): the capacity K of step t
comes from an unconstrained search over the confidences of step t-2 (not t, not t-1), per request
when R changes; candidates are ranked by their current survival; the first two decisions are
Algorithm 1's. Lossless: Appendix A's example through the scheduler, and the real engine on the
bundled demo pair (greedy identical to the target; sampled second tokens against the target's exact
law), with a control that must fail: a Markov confidence that reads the draft biases the output
once the capacity lag is removed (the retrospective search of Appendix A), never with it."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch
from click import Choice
from scipy.stats import chisquare
from tokenizers import Tokenizer

from dspark.export import contract as C
from dspark.models import load_pair
from dspark.runtime import async_scheduler
from dspark.runtime.async_scheduler import AsyncScheduler, admit_top_k, best_capacity
from dspark.runtime.backend import as_torch
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import (
    MODES,
    SchedulerConfig,
    SchedulerConfigError,
    StepScheduler,
    prefix_schedule,
    schedule,
    survival,
)
from dspark.runtime.reference_decoder import autoregressive_generate
from dspark.runtime.rejection import verify_chain
from dspark.runtime.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_thread")

DEMO = Path(str(resources.files("dspark.models") / "demo"))


def tiled(requests, tokens):
    """A jagged step cost: verified tokens are paid by tiles of 8, so Θ = τ·SPS has local maxima
    at tile edges (an early stop and the unconstrained search disagree)."""
    return 1e-3 + 2e-4 * requests + 3e-3 * np.ceil(np.asarray(tokens, dtype=np.float64) / 8)


def appendix_a_cost(requests, tokens):
    """Appendix A's curve per request: one draft costs 10× a plain step, two cost 2×, more 100×."""
    extra = np.asarray(tokens, dtype=np.float64) - requests
    return requests * np.select([extra <= 0, extra == 1, extra == 2], [1.0, 10.0, 2.0], 100.0)


@dataclasses.dataclass(frozen=True)
class CostTable:
    seconds: object  # (R, B [n]) -> seconds [n]


def table(sps: dict[int, float]):
    """Step seconds from a steps/s table over B, elementwise."""
    return lambda requests, tokens: 1.0 / np.vectorize(sps.__getitem__, otypes=[float])(tokens)


def logits_of(p) -> torch.Tensor:
    p = torch.as_tensor(p, dtype=torch.float64)
    return torch.log(p) - torch.log1p(-p)


def total(decision) -> int:
    return sum(decision.lengths)


def run(conf_seq, step_seconds=tiled, lag=None):
    sched = AsyncScheduler(lag=lag)
    return [sched.decide(confidence_logits=c, step_seconds=step_seconds) for c in conf_seq]


def random_confidences(seed: int, steps: int, requests: int = 3, gamma: int = 7) -> list[torch.Tensor]:
    """Pre-sigmoid confidences [R, γ] per step, some steps far surer than others."""
    g = torch.Generator().manual_seed(seed)
    shifts = torch.empty(steps, dtype=torch.float64).uniform_(-2.0, 8.0, generator=g)
    return [2.0 * torch.randn(requests, gamma, generator=g, dtype=torch.float64) + shift for shift in shifts.tolist()]


# -- the capacity lag -----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_capacity_of_step_t_is_the_search_over_step_t_minus_2(seed):
    conf = random_confidences(seed, 8)
    sched = AsyncScheduler()
    searched = [best_capacity(survival(c).numpy(), tiled) for c in conf]
    assert len(set(searched)) > 1  # the search moves with the confidences
    for t, c in enumerate(conf):
        promised = sched.capacity(3)
        decision = sched.decide(confidence_logits=c, step_seconds=tiled)
        if t < 2:  # warm-up: no history yet, Algorithm 1 decides
            assert promised is None
            assert decision == prefix_schedule(survival(c), tiled)
        else:
            assert promised == searched[t - 2]
            assert total(decision) == min(searched[t - 2], 3 * 7)


def test_current_and_previous_confidences_do_not_move_k_but_those_of_t_minus_2_do():
    conf = random_confidences(7, 5)
    base = run(conf)
    g = torch.Generator().manual_seed(99)
    for t in (4, 3):  # step 4's own confidences, and those of step 3 (one step earlier)
        for _ in range(5):
            changed = list(conf)
            changed[t] = 6.0 * torch.randn(3, 7, generator=g, dtype=torch.float64)
            assert total(run(changed)[4]) == total(base[4]), t
    # step 2's confidences (two steps earlier) decide it: all sure -> three tiles; all unsure -> the
    # rest of the first tile (it costs nothing more)
    sure, unsure = list(conf), list(conf)
    sure[2] = torch.full((3, 7), 8.0, dtype=torch.float64)
    unsure[2] = torch.full((3, 7), -8.0, dtype=torch.float64)
    assert total(run(sure)[4]) == best_capacity(survival(sure[2]).numpy(), tiled) == 21
    assert total(run(unsure)[4]) == best_capacity(survival(unsure[2]).numpy(), tiled) == 5


def test_capacity_is_per_request_when_requests_come_and_go():
    # a cost under which the search admits 3 candidates whatever R is
    cost = lambda requests, tokens: np.where(np.asarray(tokens) <= requests + 3, 1.0, 1000.0)  # noqa: E731
    sure = lambda rows: torch.full((rows, 7), 8.0, dtype=torch.float64)  # noqa: E731
    sched = AsyncScheduler()
    sched.decide(confidence_logits=sure(2), step_seconds=cost)  # K* = 3 for R = 2
    sched.decide(confidence_logits=sure(3), step_seconds=cost)  # K* = 3 for R = 3
    assert sched.capacity(2) == 3 and sched.capacity(5) == 8  # round(3 · 5 / 2 = 7.5): halves up
    assert total(sched.decide(confidence_logits=sure(5), step_seconds=cost)) == 8
    assert sched.capacity(1) == 1  # round(3 · 1 / 3), from the decision two steps back
    assert total(sched.decide(confidence_logits=sure(1), step_seconds=cost)) == 1
    # the capacity never exceeds the candidates that exist, nor admits a zero survival
    sched = AsyncScheduler()
    for rows in (4, 4):
        sched.decide(confidence_logits=sure(rows), step_seconds=lambda r, b: np.ones_like(b, dtype=float))
    assert sched.capacity(4) == 28
    tiny = torch.tensor([[8.0, -np.inf, 8.0], [8.0, 8.0, 8.0]], dtype=torch.float64)
    assert sched.decide(confidence_logits=tiny, step_seconds=tiled).lengths == (1, 3)


def test_unconstrained_search_looks_past_a_drop():
    """The cliff of test_scheduler_prefix: Algorithm 1 stops at 2 candidates; the async search finds
    the better maximum at 4 (it may: its result is used two steps later)."""
    a = np.array([[0.9, 0.5, 0.45], [0.6, 0.1, 0.05]])
    cliff = table({2: 1.0, 3: 0.8, 4: 0.7, 5: 0.5, 6: 10.0, 7: 0.48, 8: 0.47})
    assert total(prefix_schedule(torch.from_numpy(a), cliff)) == 2
    assert best_capacity(a, cliff) == 4
    assert best_capacity(np.array([[0.9], [0.6]]), table({2: 1.0, 3: 0.5, 4: 0.49})) == 0  # nothing pays


# -- ranking by the current survival ---------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_top_k_admits_the_k_most_probable_prefixes(seed):
    g = torch.Generator().manual_seed(seed)
    conf = torch.randn(4, 6, generator=g, dtype=torch.float64) * 3
    conf[0, 3] = -np.inf  # a zero survival from slot 3 on: never a candidate
    a = survival(conf).numpy()
    positive = int((a > 0).sum())
    for k in range(a.size + 2):
        lengths = admit_top_k(a, k)
        admitted = [(r, j) for r in range(4) for j in range(lengths[r])]
        assert len(admitted) == min(k, positive)
        worst = min((a[r, j] for r, j in admitted), default=np.inf)
        rest = [a[r, j] for r in range(4) for j in range(lengths[r], 6) if a[r, j] > 0]
        assert all(x <= worst for x in rest)  # nothing left out beats anything admitted


def test_ties_admit_a_prefix_of_each_request():
    conf = torch.tensor([[40.0, 40.0, 40.0, -1.0], [40.0, 0.0, 40.0, 40.0]])  # σ(40) == 1.0: ties at a = 1
    a = survival(conf).numpy()
    assert [tuple(admit_top_k(a, k)) for k in range(1, 6)] == [(1, 0), (2, 0), (3, 0), (3, 1), (3, 2)]


def test_the_step_uses_its_current_survivals_for_the_ranking():
    now = torch.tensor([[3.0, -3.0, 3.0], [0.5, 3.0, 3.0], [-3.0, 3.0, 3.0]], dtype=torch.float64)
    conf = [*random_confidences(3, 2), now]
    sched = AsyncScheduler()
    for c in conf[:2]:
        sched.decide(confidence_logits=c[:, :3], step_seconds=tiled)
    k = sched.capacity(3)
    decision = sched.decide(confidence_logits=conf[2], step_seconds=tiled)
    a = survival(conf[2]).numpy()
    assert decision.lengths == tuple(admit_top_k(a, k))
    assert decision.expected_accepts == pytest.approx(3 + sum(a[r, :n].sum() for r, n in enumerate(decision.lengths)))


# -- the mode -------------------------------------------------------------------------------------
def test_async_is_a_mode_beside_algorithm_1_not_the_default():
    from dspark.tools.generate_command import generate
    from dspark.tools.serve_command import serve

    assert SchedulerConfig().mode == "dspark" and "async" in MODES
    config = SchedulerConfig("async")
    assert config.needs_drafts and config.needs_cost_model
    for command in (generate, serve):
        option = next(p for p in command.params if p.name == "scheduler")
        assert isinstance(option.type, Choice) and tuple(option.type.choices) == MODES
        assert option.default == "dspark"
    with pytest.raises(SchedulerConfigError, match="StepScheduler"):
        schedule(config, requests=1, block_size=2, confidence_logits=torch.zeros(1, 2), step_seconds=tiled)
    step = StepScheduler(config)
    with pytest.raises(SchedulerConfigError, match="confidence head"):
        step.decide(requests=1, block_size=2, confidence_logits=None, step_seconds=tiled)
    with pytest.raises(SchedulerConfigError, match="cost model"):
        step.decide(requests=1, block_size=2, confidence_logits=torch.zeros(1, 2), step_seconds=None)
    assert StepScheduler(SchedulerConfig("dspark")).capacity(4) is None


def test_the_runtime_gives_async_a_cost_model(monkeypatch):
    from dspark.runtime import api

    target, drafter = load_pair(DEMO / "target", DEMO / "dspark")
    profiled = CostTable(tiled)
    monkeypatch.setattr(api, "profile_step_cost", lambda *args, **kwargs: profiled)
    for mode, expected in (("async", profiled), ("fixed", None)):
        options = api.RuntimeOptions(scheduler=SchedulerConfig(mode))
        with api.Runtime(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter), options) as runtime:
            assert runtime.cost_model is expected


# -- Appendix A through the scheduler --------------------------------------------------------------
P_TARGET = torch.tensor([0.7, 0.3])  # tokens A, B
P_DRAFT = torch.tensor([0.5, 0.5])


def appendix_a_first_tokens(lag: int | None, n: int, seed: int) -> torch.Tensor:
    """n successive steps of Appendix A's γ = 2 request (c1 = 0.8; c2 = 0.9 after A, 0 after B),
    scheduled by one AsyncScheduler on the paper's SPS table -> counts of the first output token."""
    g = torch.Generator().manual_seed(seed)
    sched = AsyncScheduler(lag=lag)
    sps = table({1: 1.0, 2: 0.5, 3: 0.45})
    target_logits, draft_logits = P_TARGET.log().expand(3, 2), P_DRAFT.log().expand(2, 2)
    counts = torch.zeros(2)
    for _ in range(n):
        x1, x2 = (int(torch.multinomial(P_DRAFT, 1, generator=g)) for _ in range(2))
        conf = logits_of([[0.8, 0.9 if x1 == 0 else 0.0]])
        (k,) = sched.decide(confidence_logits=conf, step_seconds=sps).lengths
        verdict = verify_chain(target_logits=target_logits[: k + 1], draft_tokens=torch.tensor([x1, x2][:k]),
                               draft_logits=draft_logits[:k], temperature=1.0, generator=g)
        counts[x1 if verdict.accepted_drafts >= 1 else verdict.bonus] += 1
    return counts


def test_appendix_a_async_keeps_the_target_distribution_and_lag_0_does_not():
    n = 3000
    counts = appendix_a_first_tokens(None, n, seed=0)
    assert chisquare(counts, n * P_TARGET).pvalue > 1e-3
    biased = appendix_a_first_tokens(0, n, seed=0)  # the search over the step's own confidences
    assert chisquare(biased, n * P_TARGET).pvalue < 1e-9
    assert biased[0] / n == pytest.approx(0.85, abs=0.03)  # the paper's (0.85, 0.15)


# -- the engine on the bundled demo pair -----------------------------------------------------------
@pytest.fixture(scope="module")
def demo():
    target, drafter = load_pair(DEMO / "target", DEMO / "dspark")
    tokenizer = Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json"))
    return target, drafter, tokenizer


def demo_engine(target, drafter, *, max_requests: int, cost, backend=None, pricing: str = "padded") -> BatchEngine:
    # token_budget off: decisions are replayed from the recorded confidences alone (the budget reads token counts
    # the record lacks), and the second token's law needs drafts verified at a 2-token request's last token
    return BatchEngine(backend or TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                       capacity=Capacity(max_requests, max_requests * 160, 160),
                       scheduler=SchedulerConfig("async", pricing=pricing, token_budget=False),
                       cost_model=CostTable(cost))


GREEDY_TEXTS = ["def parse_args(", "    for line in lines:\n        if ", "import os\nimport sys\n\n",
                "class Queue:\n    def __init__(self", "        if self.break_long_words:", "    return ''.join("]


@pytest.mark.parametrize("pricing", ["padded", "packed"])
def test_greedy_equals_the_target_with_requests_arriving_mid_flight(demo, pricing):
    target, drafter, tokenizer = demo
    engine = demo_engine(target, drafter, max_requests=3, cost=tiled, pricing=pricing)
    prompts = [tokenizer.encode(t).ids for t in GREEDY_TEXTS]
    budgets = [24, 17, 30, 12, 21, 26]
    ids = {}
    for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        ids[engine.submit(prompt, max_new_tokens=budget)] = i
        engine.step()  # a request joins every step while the others are mid-flight: R changes
    finished = engine.run_until_done()
    for request_id, i in ids.items():
        assert finished[request_id].tokens == autoregressive_generate(target, prompts[i], max_new_tokens=budgets[i])
    # The decisions were the async scheduler's (replayed from the recorded confidences), they
    # verified drafts, and they differ from Algorithm 1 on the same confidences.
    steps = [s for s in engine.stats.steps if s.requests and s.confidence_logits is not None]  # decisions made
    replay = AsyncScheduler(padded=pricing == "padded")
    differs = 0
    for s in steps:
        assert list(replay.decide(confidence_logits=s.confidence_logits, step_seconds=tiled).lengths) == s.lengths
        synchronous = prefix_schedule(survival(s.confidence_logits), tiled, padded=pricing == "padded")
        differs += tuple(s.lengths) != synchronous.lengths
    assert differs > 0 and sum(sum(s.lengths) for s in steps) > 0
    assert len({s.requests for s in steps}) > 1


# "it.\n        if self.break_long_words:" (textwrap.py, tokenized with the demo tokenizer): the first
# new token is nearly certain, the second spread over a few (P = 0.43, 0.15, ...).
SAMPLING_PROMPT = [298, 15, 265, 303, 291, 15, 3725, 64, 1906, 64, 2625, 27]


@torch.no_grad()
def exact_second_token(target, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(2nd new token) = Σ_t1 p(t1) p(t2 | t1) under the target at `temperature` [V] (float64): every t1
    as one more token after the prompt's cached keys and values."""
    out = target(torch.tensor([prompt]), torch.arange(len(prompt))[None])
    p1 = torch.softmax(out.logits[0, -1].double() / temperature, -1)
    vocab = p1.shape[0]
    past = [(k.expand(vocab, -1, -1, -1), v.expand(vocab, -1, -1, -1)) for k, v in out.present]
    logits = target(torch.arange(vocab)[:, None], torch.full((vocab, 1), len(prompt)), past_key_values=past).logits
    return p1 @ torch.softmax(logits[:, -1].double() / temperature, -1)


@pytest.fixture(scope="module")
def demo_law(demo):
    return exact_second_token(demo[0], SAMPLING_PROMPT, 1.0)


def second_tokens(engine: BatchEngine, n: int, vocab: int) -> torch.Tensor:
    ids = [engine.submit(SAMPLING_PROMPT, max_new_tokens=2, temperature=1.0, seed=s) for s in range(n)]
    finished = engine.run_until_done()
    counts = torch.zeros(vocab, dtype=torch.float64)
    for i in ids:
        counts[finished[i].tokens[1]] += 1
    return counts


def pooled_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected >= 5
    observed = torch.cat((counts[keep], counts[~keep].sum()[None]))
    expected = torch.cat((expected[keep], expected[~keep].sum()[None]))
    return float(chisquare(observed.numpy(), (expected * observed.sum() / expected.sum()).numpy()).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("pricing", ["padded", "packed"])
def test_sampling_follows_the_target_law(demo, demo_law, pricing):
    target, drafter, _ = demo
    engine = demo_engine(target, drafter, max_requests=16, cost=tiled, pricing=pricing)
    counts = second_tokens(engine, 800, target.config.vocab_size)
    lengths = [k for s in engine.stats.steps for k in s.lengths]
    assert max(lengths) > 0  # drafts verified
    assert len(set(lengths)) > 1 or pricing == "padded"  # packed: top-K lengths vary
    assert pooled_pvalue(counts, demo_law) > 1e-3
    assert pooled_pvalue(counts, exact_second_token(target, SAMPLING_PROMPT, 0.7)) < 1e-6  # the test can tell


class DraftReadingConfidence(TorchBackend):
    """The demo drafter with Appendix A's kind of Markov confidence: slot 1 is sure, slot j > 1 is sure
    iff draft j-1 is the token `favoured` (its head step gets the previous draft as `prev_ids`)."""

    def __init__(self, target, drafter, favoured: int) -> None:
        super().__init__(target, drafter)
        self.favoured, self.calls = favoured, 0

    def _run(self, graph, feeds):
        out = super()._run(graph, feeds)
        if graph == C.HEAD_STEP:  # called once per block slot, in order
            slot, self.calls = self.calls % self.drafter.config.block_size, self.calls + 1
            prev = as_torch(feeds["prev_ids"])
            sure = torch.ones_like(prev, dtype=torch.bool) if slot == 0 else prev == self.favoured
            out["confidence_logit"] = torch.where(sure, 20.0, -20.0).to(out["confidence_logit"].dtype)
        return out


@pytest.mark.slow
@pytest.mark.parametrize("lag", [None, 0], ids=["async", "lag-0-control"])
def test_a_confidence_that_reads_the_draft_biases_only_a_retrospective_search(demo, demo_law, monkeypatch, lag):
    """One request per step, Appendix A's cost: the step's own search admits draft 1 iff draft 1 is the
    favoured token (then a sure continuation makes two drafts pay), so the output over-weights it
    (the control, lag 0, must fail). The async scheduler's capacity comes from an earlier step, so
    the same confidences cannot choose what they admit: the target's law holds."""
    target, drafter, _ = demo
    law = demo_law
    backend = DraftReadingConfidence(target, drafter, favoured=int(law.argmax()))
    if lag is not None:
        monkeypatch.setattr(async_scheduler, "LAG", lag)
    engine = demo_engine(target, drafter, max_requests=1, cost=appendix_a_cost, backend=backend)
    n = 600
    counts = second_tokens(engine, n, target.config.vocab_size)
    decode_steps = sum(1 for s in engine.stats.steps if s.requests)
    assert backend.calls == decode_steps * drafter.config.block_size  # every step went through the head
    lengths = [k for s in engine.stats.steps for k in s.lengths]
    assert 0.2 * n < sum(k == 2 for k in lengths) < 0.8 * n  # two drafts admitted, often but not always
    if lag is None:
        assert pooled_pvalue(counts, law) > 1e-3
    else:  # the bias shrinks as the drafter nears the target (demo pair v3: p 1e-6..2e-3 at 200 draws)
        assert pooled_pvalue(counts, law) < 1e-6
