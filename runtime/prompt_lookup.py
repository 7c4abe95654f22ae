"""Prompt-lookup drafts beside the DSpark drafter: copy what followed the last n tokens earlier on.

Code, retrieval and chat histories repeat themselves; where a request's last n committed tokens
occurred before in its prompt or output, the tokens that followed them there are a draft that costs
no drafter call (onnxruntime-genai's and vLLM's n-gram speculation, transformers' prompt lookup).
Here it is a second proposer, per request and per step: a request whose history has such a
match verifies the copied tokens instead of drafting with DSpark when copying is expected to return
more tokens per second, and is then skipped by the drafter (its context rows wait for its next
DSpark step, like a row the drafting gate left out). Only in steps where the drafting gate lets every
row draft: a copy replaces a block that drafting was expected to pay for, and never adds verification
where the gate found drafting does not pay (measured, 16 requests on the demo engine: copies verified
in steps the gate declined widened the padded verification 2.8x for 1.5x the accepted tokens, and the
run ran at 0.57x the gate's).

The choice. Each request keeps the copied drafts' acceptance, p = per-token chance that a copied
draft survives given its prefix did (successes and failures of its own lookup steps, decayed by
`ACCEPTANCE_DECAY` a copy and by `FORGET_DECAY` a step with a match that did not copy, with `PRIOR_TRIALS`
pseudo-trials at an optimistic `PRIOR_ACCEPTANCE`, so that a request whose copies failed tries again some
steps later), so a copy of ℓ tokens
is expected to add Σ_{j≤ℓ} p^j accepted drafts; and the survival sum of its last DSpark blocks
(Σ_j Π_{i≤j} c_i, the confidence head's expected accepted drafts of a full block; the engine's mean
for a request that has not drafted yet). Per row, with the step cost model's shares of drafting and
verifying (`SplitStepCost`), it copies iff

    (1 + Σ p^j) / verify  ≥  (1 + expected DSpark accepts) / (draft + verify).

The copied drafts then enter Algorithm 1 as candidates of survival p^j, beside the DSpark rows' own
survivals: how many are verified is priced like every other draft. A copy may run past the block, to
`max_tokens` (twice the block by default), since it costs no drafter call whatever its length; measured on
the bundled pair's held-out prompts, single stream: 80 of 102 copies of 7 were accepted whole, and copies up
to 14 made the scheduler 9 % faster (2709 against 2486 tok/s, median of 3 interleaved rounds; 11 and 23
within noise of 14). A copy never runs past the tokens its request still needs, so its verification stays
inside the request's KV reservation (prompt + new tokens + one block).

Lossless: the match, the copy and p depend on committed tokens and earlier steps only, never on this
step's drafts. A copied draft is a deterministic proposal: under greedy verification a row's output is
the target's argmax chain whatever it verifies, and a sampling row verifies it by the standard rule with
q the point mass on the copied token (`copy_logits`): accepted with probability p(x), else the bonus is
drawn from normalise(max(p − q, 0)), p without x, which leaves the output's law the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .proposer import DraftBlock

ACCEPTANCE_DECAY = 0.8  # per lookup step of the request: p follows its last ~5 copies
FORGET_DECAY = 0.95  # per step with a match that did not copy: failed copies are retried ~15-30 steps later
PRIOR_TRIALS = 1.0  # pseudo-trials in p's estimate, at PRIOR_ACCEPTANCE
PRIOR_ACCEPTANCE = 0.8  # optimistic: a copy that fails costs one verify-only step, and teaches p
DSPARK_DECAY = 0.8  # per DSpark step of the request: the expected accepts follow its last ~5 blocks


@dataclass
class LookupState:
    """One request's n-gram index over its committed tokens (prompt, then output) and its two estimates."""

    n: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its latest occurrence
    indexed: int = 0  # n-grams ending before this position are in `ends`
    successes: float = 0.0  # decayed copied drafts accepted
    failures: float = 0.0  # decayed copied drafts rejected (at most one a step)
    dspark_accepts: float | None = None  # decayed mean survival sum of its DSpark blocks; None before any

    def continuation(self, prompt: list[int], tokens: list[int], limit: int) -> list[int]:
        """`limit` tokens that followed the latest earlier occurrence of the history's last n tokens (history =
        prompt + tokens; where they run into the present, the repeat continues), [] without one. Indexes the
        positions added since the last call."""
        n, size, cut = self.n, len(prompt) + len(tokens), len(prompt)

        def window(begin: int, end: int) -> list[int]:
            if end <= cut:
                return prompt[begin:end]
            if begin >= cut:
                return tokens[begin - cut : end - cut]
            return prompt[begin:] + tokens[: end - cut]

        if size <= n:
            return []
        # n-grams ending at n .. size - 1: every one but the history's own suffix
        for end in range(max(self.indexed, n), size):
            self.ends[tuple(window(end - n, end))] = end
        self.indexed = max(self.indexed, size)
        end = self.ends.get(tuple(window(size - n, size)))
        if end is None:
            return []
        copy = window(end, min(end + limit, size))
        while len(copy) < limit:  # the match runs into the present: the pattern repeats with period size - end
            copy += copy[: limit - len(copy)]
        return copy

    @property
    def acceptance(self) -> float:
        """p: the chance a copied draft survives given its prefix did."""
        return (self.successes + PRIOR_ACCEPTANCE * PRIOR_TRIALS) / (self.successes + self.failures + PRIOR_TRIALS)

    def survivals(self, length: int, width: int) -> np.ndarray:
        """[width] p^j for the copy's `length` slots, 0 after."""
        out = np.zeros(width)
        out[:length] = self.acceptance ** np.arange(1, length + 1)
        return out

    def verified(self, drafts: int, accepted: int) -> None:
        """A lookup step verified `drafts` copied drafts and accepted `accepted` of them."""
        if drafts:
            self.successes = self.successes * ACCEPTANCE_DECAY + accepted
            self.failures = self.failures * ACCEPTANCE_DECAY + (accepted < drafts)

    def forget(self) -> None:
        """A step with a match that did not copy: what the request's copies taught fades, slowly."""
        self.successes *= FORGET_DECAY
        self.failures *= FORGET_DECAY

    def drafted(self, survival_sum: float) -> None:
        """A DSpark step drafted a block whose survivals sum to `survival_sum`."""
        previous = self.dspark_accepts
        self.dspark_accepts = survival_sum if previous is None else (
            DSPARK_DECAY * previous + (1.0 - DSPARK_DECAY) * survival_sum)


@dataclass(frozen=True)
class LookupDrafts:
    """One step's copied drafts over the R active rows."""

    rows: np.ndarray  # [k] rows that verify copied drafts instead of drafting with DSpark, ascending
    tokens: np.ndarray  # [R, L] int64, row r's copy first (rows not in `rows`: zeros); L >= γ: the longest copy
    survivals: np.ndarray  # [R, L] p^j over each copy (rows not in `rows`: zeros)


def copies_pay(lookup_accepts: float, dspark_accepts: float, draft_share: float, verify_share: float) -> bool:
    """The module docstring's rule: tokens per second of a copy against a DSpark block, per row."""
    return (1.0 + lookup_accepts) * (draft_share + verify_share) >= (1.0 + dspark_accepts) * verify_share


class PromptLookup:
    """The engine's lookup proposer: asked once a step for the rows that copy (`propose`), told what their
    verification and the DSpark rows' blocks showed (`record`). Keeps its per-request state on each
    `RunningRequest.lookup`, so it follows the request through row moves and host tiers."""

    def __init__(self, n: int, block_size: int, cost: object | None = None, *, max_tokens: int | None = None) -> None:
        if n < 1:
            raise ValueError(f"prompt lookup needs n >= 1, got {n}")
        self.max_tokens = 2 * block_size if max_tokens is None else max_tokens  # the longest copy
        if self.max_tokens < 1:
            raise ValueError(f"prompt lookup copies need max_tokens >= 1, got {self.max_tokens}")
        self.n, self.block_size, self.cost = n, block_size, cost
        self.width = max(block_size, self.max_tokens)  # of the step's draft rows when a row copies
        self.dspark_accepts: float | None = None  # engine-wide decayed mean survival sum of DSpark blocks
        self._shares: tuple[int, float, float] | None = None  # (R, draft share, verify share) last priced
        self.copies = 0  # rows that verified a copy, over the engine's life
        self.copies_accepted = 0  # copied drafts accepted, over the engine's life

    def shares(self, requests: int) -> tuple[float, float]:
        """(drafting, verifying) seconds of one row's full block, as the cost model prices R rows; (0, 1)
        without a cost model that prices them apart (then a copy must promise what DSpark does)."""
        if self._shares is not None and self._shares[0] == requests:
            return self._shares[1:]
        draft = getattr(self.cost, "draft_seconds", None)
        verify = getattr(self.cost, "verify_seconds", None)
        if draft is None or verify is None:
            return 0.0, 1.0
        width = requests * (1 + self.block_size)
        self._shares = (requests, float(draft(requests)) / requests, float(verify(requests, width)) / requests)
        return self._shares[1:]

    def propose(self, active: list, room: int) -> LookupDrafts | None:
        """The rows of `active` (RunningRequest) that copy this step, with their copies; None if none. `room`:
        drafts the fullest row's slot still holds past its anchor (verification pads every row to the widest)."""
        rows, width = len(active), self.width
        draft_share, verify_share = self.shares(rows)
        chosen, tokens, survivals = [], None, None
        for r, a in enumerate(active):
            if a.lookup is None:
                a.lookup = LookupState(self.n)
            state = a.lookup
            # no longer than the request still needs, nor than the fullest slot holds (each reserves one block more)
            limit = min(self.max_tokens, a.max_new_tokens - len(a.result.tokens), room)
            copy = state.continuation(a.result.prompt_ids, a.result.tokens, limit) if limit > 0 else []
            dspark = state.dspark_accepts if state.dspark_accepts is not None else self.dspark_accepts
            if not copy or dspark is None:  # no match, or nothing yet to weigh a copy against: DSpark drafts
                continue
            row = state.survivals(len(copy), width)
            if not copies_pay(float(row.sum()), dspark, draft_share, verify_share):
                state.forget()  # p drifts back to its prior: a request whose copies failed tries again later
                continue
            if tokens is None:
                tokens, survivals = np.zeros((rows, width), np.int64), np.zeros((rows, width))
            chosen.append(r)
            tokens[r, : len(copy)] = copy
            survivals[r] = row
        return None if not chosen else LookupDrafts(np.array(chosen, np.int64), tokens, survivals)

    def record(self, active: list, copies: LookupDrafts | None, drafted: np.ndarray,
               survivals: np.ndarray | None, lengths: np.ndarray, accepted: list[int]) -> None:
        """After verification: rows in `copies` verified lengths[r] copied drafts and kept accepted[r] - 1 of
        them; rows `drafted` drafted DSpark blocks whose survivals [R, γ] are `survivals`."""
        if copies is not None:
            for r in copies.rows.tolist():
                active[r].lookup.verified(int(lengths[r]), accepted[r] - 1)
                self.copies += 1
                self.copies_accepted += accepted[r] - 1
        if survivals is None or not len(drafted):
            return
        sums = survivals[drafted].sum(axis=1).tolist()
        for r, total in zip(drafted.tolist(), sums, strict=True):
            state = active[r].lookup
            if state is not None:
                state.drafted(total)
        mean = sum(sums) / len(sums)  # (np.mean of a list: ~6 µs a step more)
        previous = self.dspark_accepts
        self.dspark_accepts = mean if previous is None else DSPARK_DECAY * previous + (1.0 - DSPARK_DECAY) * mean


def with_copies(copies: LookupDrafts, block: DraftBlock | None, survivals: np.ndarray | None,
                temperatures: Sequence[float], vocab_size: int) -> tuple[DraftBlock, np.ndarray]:
    """This step's drafts over all R rows and Algorithm 1's survivals, [R, L] (L: the copies' width, >= γ): the
    DSpark rows' (`block`, None: no row drafted; `survivals` [R, γ], None: none to verify, rows that did not draft
    carry survival 0; both 0 past γ) with the copying rows' in place, their draft logits the point mass on the
    copy for sampling rows (`copy_logits`)."""
    width = copies.tokens.shape[1]
    tokens = copies.tokens.copy() if block is None else _widened(np.asarray(block.tokens, dtype=np.int64), width)
    survivals = np.zeros(copies.survivals.shape) if survivals is None else _widened(survivals, width)
    tokens[copies.rows], survivals[copies.rows] = copies.tokens[copies.rows], copies.survivals[copies.rows]
    logits = copy_logits(copies, None if block is None else block.logits, temperatures, vocab_size)
    return DraftBlock(tokens, logits, None if block is None else block.confidence_logits), survivals


def _widened(rows: np.ndarray, width: int) -> np.ndarray:
    """A copy of [R, γ, ...] `rows` as [R, width, ...], zeros past γ."""
    out = np.zeros((rows.shape[0], width, *rows.shape[2:]), rows.dtype)
    out[:, : rows.shape[1]] = rows
    return out


def drafted_verified(drafted: np.ndarray, survivals: np.ndarray, lengths: np.ndarray,
                     accepted: list[int]) -> tuple[float, int] | None:
    """(drafts Algorithm 1 expected accepted, drafts accepted) over the rows that drafted with DSpark, as the
    drafting gate learns them; None when they verified no draft. survivals [R, γ], lengths [R] verified
    drafts, accepted [R] tokens kept (drafts + 1)."""
    verified = lengths[drafted]
    if not len(drafted) or not verified.any():
        return None
    expected = float(sum(survivals[r, :k].sum() for r, k in zip(drafted.tolist(), verified.tolist(), strict=True)))
    return expected, int(sum(accepted[r] - 1 for r in drafted.tolist()))


def copy_logits(copies: LookupDrafts, logits: torch.Tensor | np.ndarray | None, temperatures: Sequence[float],
                vocab_size: int) -> torch.Tensor | np.ndarray | None:
    """The draft logits [R, L, V] the rejection rule reads for sampling rows, with each sampling row that copied
    given the point mass on its copied tokens (0 there, −inf elsewhere: q = 1 on the copy); greedy rows are
    never read. `logits`: the DSpark rows' [R, γ, V] (None: no sampling row drafted), zeros past γ."""
    sampled = [r for r in copies.rows.tolist() if temperatures[r] > 0]
    if not sampled:
        return logits
    rows, width = copies.tokens.shape
    logits = None if logits is None else torch.as_tensor(logits)
    out = torch.zeros((rows, width, vocab_size), dtype=torch.float32 if logits is None else logits.dtype)
    if logits is not None:
        out[:, : logits.shape[1]] = logits
    index = torch.from_numpy(copies.tokens[sampled])  # [k, L]
    out[sampled] = torch.full((len(sampled), width, vocab_size), -torch.inf, dtype=out.dtype).scatter_(
        2, index[:, :, None], 0.0)
    return out
