"""The asynchronous prefix scheduler (DSpark paper §5.2): scheduler mode `async`.

Algorithm 1 decides a step's verification length only once that step's drafts and confidences
exist. Overlapped (zero-overhead) scheduling and CUDA-graph replay need the step's batch size
earlier, while the step before it is still running. So, as in §5.2:

- **Capacity K from two steps earlier.** At every step the scheduler runs an *unconstrained*
  search over the step's own survivals a_{r,j} = Π_{i≤j} σ(c_{r,i} / T_i): with the candidates sorted
  by a descending, τ(K) = R + (sum of the K largest a) and K* = argmax_K τ(K)·SPS(R + K), over every
  K from 0 to the number of candidates with a > 0 (no early stop, so a jagged SPS curve does not
  trap it; the smallest K wins a tie). That K* is not used now: it is the capacity of the step two
  decisions later.
- **Ranking by the current confidences.** Step t admits the K_t candidates with the largest
  *current* survival (ties: request, then position, as Algorithm 1), so each request verifies a
  prefix of its block and the most confident drafts always go first: a dynamic top-K.

**K across changing batches.** Requests join and leave between steps, so K is kept per request:
step t-2 stores (K*, R_{t-2}), and step t with R_t requests admits
K_t = round(K* · R_t / R_{t-2}) (halves up, in integers; exactly K* when R is unchanged), clipped to
the R_t · γ candidates that exist, and only candidates with a > 0 are ever admitted. A per-request
capacity follows the load when the batch grows or shrinks, where a fixed token count would starve a
batch that doubled or flood one that halved. B_t = R_t + K_t is then an upper bound on the step's
verified tokens known before its drafts exist (`StepScheduler.capacity(R)` for the engine).

**Padded verification** (`SchedulerConfig.pricing` "padded", the default). Where the target verifies
[R, W] rows (our ONNX Runtime graphs), a row that admits fewer than W drafts saves nothing, so the
search is over a depth: d* = argmax_d τ(d)·SPS(R·(1 + d)), τ(d) = R·(1 + the mean over drafting rows
of Σ_{j<d} a_j), and step t admits every row's candidates up to d*_{t-2} (a per-request quantity, so
no rescaling when R changes). The argument below holds unchanged: d*_{t-2} is fixed before step t's
drafts exist, and a row's admitted slots are its first d*_{t-2} candidates with a > 0, which depend
on x_{r,<k} only.

**With the drafting gate** (drafting_gate.py) some steps draft for a few rows or none. Rows that did
not draft have confidence −inf (survival 0, no candidate); the packed capacity is kept per drafting
row (K* · D_t / D_{t-2}, D the rows that drafted, chosen by the gate from committed history), and a
step in which nothing drafted makes no decision. Which rows draft never depends on the step's drafts.

**Prompt-lookup copies** (`prompt_lookup.py`) are candidates too, with their request's survivals p^j (up to
twice the block): a copy is a function of committed tokens, no random draw, and p of earlier steps, so the
argument below holds with them among the candidates; a step where only copies verify decides from their
survivals alone.

**Warm-up.** The first two decisions have no history: they are synchronous Algorithm 1 decisions
(`prefix_schedule`, early stop), which are lossless on their own; their searches still feed the
capacity of decisions three and four. A "step" here is one `decide` call: an engine step with no
active request makes none, and the history outlives an idle engine (per-request capacity stays
meaningful).

**Why it is lossless (Appendix A, adapted).** Lossless speculative decoding needs the admission of
draft token x_{r,k} (the event ℓ_r ≥ k) to be decided by information that, given the committed
context and x_{r,<k}, does not depend on x_{r,k} itself; the accept/reject rule then returns the
target's distribution whatever else the admission looked at. Appendix A shows what goes wrong
otherwise: the Markov confidence c_{r,k+1} is computed from x_{r,k}, so an unconstrained search over
the *current* survivals lets x_{r,k} decide its own admission (in the paper's example a token that
leads to confident continuations is admitted, one that does not is not), and the output is biased:
(0.85, 0.15) instead of (0.7, 0.3). Here:

1. K_t depends only on survivals of step t-2, the cost model and R_t: all fixed before any draft of
   step t is sampled. Step t's drafts are drawn fresh, conditioned on the committed context alone,
   so they are independent of K_t. (The t-2 drafts that shaped K_t were verified, accepted or
   replaced, and are never reused; the committed tokens they produced follow the target by the same
   argument one step earlier, by induction.) The unconstrained search's retrospective dependence on
   x_{r,k} is real, but it only moves a capacity used two steps later, behind a causal barrier.
2. Given K_t, (r, k) is admitted iff fewer than K_t candidates rank ahead of it. Those ahead of it
   are (r, j < k), whose survivals depend on x_{r,<k} only, and other requests' candidates, which
   depend on their own drafts, drawn independently of x_{r,k}. Request r's later slots never rank
   ahead: a_{r,k+1} = a_{r,k} · σ(c_{r,k+1}) ≤ a_{r,k}, and a tie goes to the earlier position. So
   the event ℓ_r ≥ k is a function of information available before x_{r,k} is drawn, which is
   Appendix A's non-anticipating condition; no early stop is needed for it.

Using step t-1 would be as lossless; the second lag is what overlapping needs (step t's batch is
sized while step t-1 runs, before its confidences exist). tests/test_async_scheduler.py checks
the lag, the ranking, greedy identity and the sampled distribution, and that a lag of 0 (the
retrospective search of Appendix A) is caught.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from .prefix_scheduler import Decision, SchedulerConfigError, StepSeconds, prefix_schedule, survival

LAG = 2  # decisions between the confidences a capacity is computed from and the step that uses it


def _ranked(survivals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidates with a > 0 of survivals [R, γ], by descending survival, then request, then
    position -> (rows [n], cols [n], a [n]) in that order."""
    rows, cols = np.nonzero(survivals > 0)
    values = survivals[rows, cols].astype(np.float64)
    order = np.lexsort((cols, rows, -values))
    return rows[order], cols[order], values[order]


def best_capacity(survivals: np.ndarray, step_seconds: StepSeconds) -> int:
    """Unconstrained search over survivals [R, γ]: K* = argmax over K = 0..n of
    τ(K) / step_seconds(R, R + K), τ(K) = R + the K largest survivals (the first maximum wins)."""
    return _capacity_search(survivals, step_seconds)[0]


def _capacity_search(survivals: np.ndarray, step_seconds: StepSeconds) -> tuple[int, np.ndarray]:
    """`best_capacity` and the step's price at every K = 0..n it searched (B = R + K)."""
    requests = survivals.shape[0]
    _, _, a = _ranked(survivals)
    tau = np.cumsum(np.concatenate(([float(requests)], a)))  # τ(K) for K = 0..n
    seconds = np.asarray(step_seconds(requests, requests + np.arange(a.size + 1)), dtype=np.float64)
    return int(np.argmax(tau / seconds)), seconds


def best_depth(survivals: np.ndarray, step_seconds: StepSeconds) -> int:
    """The padded form of the search: verification runs [R, 1 + d] rows whatever each row admits, so
    the choice is a depth. d* = argmax over d = 0..γ of τ(d) / step_seconds(R, R·(1 + d)), with
    τ(d) = R·(1 + the mean over drafting rows of Σ_{j<d} a_j): rows like those that drafted (a probe's
    few rows stand for all of them; rows that did not draft have survival 0). First maximum wins."""
    return _depth_search(survivals, step_seconds)[0]


def _depth_search(survivals: np.ndarray, step_seconds: StepSeconds,
                  drafted: int | None = None) -> tuple[int, np.ndarray | None]:
    """`best_depth` and the step's price at every depth d = 0..γ (B = R·(1 + d)); None where no row drafted.
    `drafted`: the rows with a candidate, where the caller counted them."""
    requests, gamma = survivals.shape
    if drafted is None:
        drafted = np.count_nonzero(survivals[:, 0]) if gamma else 0
    if not drafted:
        return 0, None
    # the mean over drafting rows: the others' survivals are 0 (ndarray.mean was ~17 µs of a one-row step)
    tau = requests * (1.0 + np.concatenate(([0.0], np.cumsum(survivals.sum(axis=0) / drafted))))  # τ(d), d = 0..γ
    seconds = np.asarray(step_seconds(requests, requests * (1 + np.arange(gamma + 1))), dtype=np.float64)
    return int(np.argmax(tau / seconds)), seconds


def admit_top_k(survivals: np.ndarray, k: int) -> np.ndarray:
    """The k highest-ranked candidates of survivals [R, γ] (a > 0 only) -> lengths [R]: each request's
    admitted slots form a prefix because survival never rises along a row and ties go to position."""
    rows, cols, _ = _ranked(survivals)
    lengths = np.zeros(survivals.shape[0], dtype=np.int64)
    np.maximum.at(lengths, rows[:k], cols[:k] + 1)
    return lengths


class AsyncScheduler:
    """Mode `async`: top-K by current survival, K from the unconstrained search of `lag` decisions
    earlier (see the module docstring). One per engine; `decide` once per step. `lag` 0 makes the
    search retrospective (Appendix A's biased scheduler): only for tests that must catch it.

    `padded` (SchedulerConfig.pricing "padded", the default): the target verifies [R, W] rows, so
    admitting fewer than W drafts in a row saves nothing; the capacity is a depth d* (`best_depth`)
    and every row admits its candidates up to it. Packed: a token count K*, per drafting row (rows the
    drafting gate left out have confidence −inf), admitted top-K by current survival."""

    def __init__(self, temperatures: tuple[float, ...] | None = None, *, lag: int | None = None,
                 padded: bool = False) -> None:
        lag = LAG if lag is None else lag
        if lag < 0:
            raise SchedulerConfigError(f"the capacity lag must be >= 0 decisions, got {lag}")
        self.temperatures, self.lag, self.padded = temperatures, lag, padded
        # (K*, drafting rows) or (d*, rows) of the last `lag` decisions, oldest first
        self._searched: deque[tuple[int, int]] = deque()

    def capacity(self, requests: int) -> int | None:
        """Draft tokens the next `decide` admits for `requests` drafting rows, at most (only candidates
        with a > 0 are admitted, never more than R·γ), known before that step's drafts exist; None while
        warming up (that decision is synchronous) or with lag 0."""
        if self.lag == 0 or len(self._searched) < self.lag or requests <= 0:
            return None
        k, then = self._searched[0]
        if self.padded:
            return k * requests
        return (2 * k * requests + then) // (2 * then)  # round(K* · R_t / R_{t-lag}), halves up

    def decide(self, *, confidence_logits: torch.Tensor | None,  # [R, γ]; rows that did not draft: −inf
               step_seconds: StepSeconds | None, survivals: np.ndarray | None = None) -> Decision:
        if confidence_logits is None and survivals is None:
            raise SchedulerConfigError("scheduler mode 'async' needs a drafter with a confidence head")
        if step_seconds is None:
            raise SchedulerConfigError("scheduler mode 'async' needs a step cost model")
        # [R, L]; `survivals` where the caller has them at these temperatures (prompt-lookup copies among them:
        # L up to their width; a step where only copies verify has no confidences)
        a = survival(confidence_logits, self.temperatures).numpy() if survivals is None else survivals
        requests, gamma = a.shape
        if requests == 0:
            return Decision((), 0.0, None, 0)
        drafting = np.count_nonzero(a[:, 0]) if gamma else 0  # rows with candidates: survival 0 where none
        if self.padded:  # for the decision `lag` steps on (and this step's price, where it searched it)
            best, prices = _depth_search(a, step_seconds, drafting)
            searched = (best, requests)
        else:
            best, prices = _capacity_search(a, step_seconds)
            searched = (best, max(drafting, 1))
        capacity = self.capacity(requests if self.padded else drafting)
        if self.lag:
            if len(self._searched) >= self.lag:
                self._searched.popleft()
            self._searched.append(searched)
        if capacity is None and self.lag:  # warm-up: Algorithm 1 with its early stop
            return prefix_schedule(a, step_seconds, padded=self.padded)
        if self.padded:
            depth = searched[0] if capacity is None else capacity // requests
            lengths = np.minimum(depth, (a > 0).sum(axis=1))
            drafts = int(lengths.max(initial=0))  # the priced depth
            tokens = requests * (1 + drafts)
        else:
            lengths = admit_top_k(a, searched[0] if capacity is None else min(capacity, requests * gamma))
            drafts = int(lengths.sum())  # the priced K
            tokens = requests + drafts
        tau = requests + float(a[np.arange(gamma) < lengths[:, None]].sum())
        # the search priced B = tokens already (d or K within its range); a second call cost ~15 µs a step
        seconds = prices[drafts] if prices is not None and drafts < prices.size else \
            float(np.asarray(step_seconds(requests, np.array([tokens])))[0])
        return Decision(tuple(lengths.tolist()), tau, tau / seconds, int((a > 0).sum()))
