"""How many draft tokens each request verifies this step: the hardware-aware prefix scheduler.

Algorithm 1 of the DSpark paper (§3.2.2): survival a_{r,j} = Π_{i≤j} c_{r,i}; candidates (r, j)
with a_{r,j} > 0 sorted by a descending; starting from B = R tokens (every request verifies its
anchor) and τ = R expected accepts, admit candidates one by one while the expected throughput
Θ = τ·SPS(B) rises, and stop at the first candidate that does not raise it. The early stop is
what keeps decoding lossless: the admission of token j of request r depends only on candidates
with a survival ≥ a_{r,j}, never on the draft token x_{r,j} itself (Appendix A).

Modes: `dspark` (Algorithm 1), `async` (§5.2: top-K by current survival, the capacity K from an
unconstrained search over the confidences of two steps earlier; `async_scheduler.py`), `fixed`
(γ' tokens), `threshold` (first per-slot confidence below a threshold, DeepSpec's static rule),
`off` (0 drafts: plain autoregressive decoding). In `dspark` and `async` modes with chain drafting, requests
may verify a prompt-lookup copy instead of a DSpark block (`prompt_lookup`, n = 3 by default; 0: off): the
copies enter Algorithm 1 (or the asynchronous search and ranking) as candidates beside the DSpark rows'.

Algorithm 1 itself (`admit_by_throughput`, `ThroughputRule`) is written once here; the tree node
scheduler (`tree_builder.node_budgets`, and `build_tree` while it grows a tree) runs the same rule
over tree nodes instead of chain slots.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

MODES = ("dspark", "async", "fixed", "threshold", "off")
PRICING = ("padded", "packed")
DRAFTING = ("chain", "tree")

# (requests R, verified tokens B [n]) -> seconds per step [n], elementwise, as the cost models compute it
StepSeconds = Callable[[int, np.ndarray], np.ndarray]
# (expected accepts τ [n], verified tokens B [n]) -> Θ tokens/s [n], elementwise
Throughput = Callable[[np.ndarray, np.ndarray], np.ndarray]


class SchedulerConfigError(ValueError):
    """A scheduler mode or parameter that cannot be used as given."""


@dataclass(frozen=True)
class SchedulerConfig:
    mode: str = "dspark"
    fixed_length: int | None = None  # `fixed`: draft tokens per request (None = the block size)
    threshold: float = 0.5  # `threshold`: per-slot σ(c) cut-off
    confidence_temperatures: tuple[float, ...] | None = None  # STS, one per block slot
    gate_drafting: bool = True  # `dspark`, `async`: skip drafting when the cost table says it cannot pay
    # a probe whose drafts are not verified (padded pricing) drafts on a worker thread while the target verifies
    overlap_probes: bool = True
    # how verification is priced: "padded" (the target computes [R, W] rows, so B = R·W), "packed"
    # (B = Σ(1 + ℓ_r), the paper's packed verification) or None: as the engine's target graph computes
    # (packed with `target_fused_packed`, else padded; padded where no engine resolves it)
    pricing: str | None = None
    # "tree": draft trees over all requests (runtime/tree_step.py; modes dspark and fixed)
    drafting: str = "chain"
    tree_nodes: int = 16  # tree drafting: draft nodes per request at most (`fixed`: exactly, where the block allows)
    tree_top_k: int = 4  # tree drafting: children offered per expanded node
    # `dspark` chain drafting, n > 0: a request whose last n tokens occurred earlier may verify what
    # followed there instead of a DSpark block (prompt_lookup.py); 0: off
    prompt_lookup: int = 3
    lookup_tokens: int | None = None  # the longest copy a request verifies in a step; None: twice the block size
    # `dspark`, `async`: no draft verified past what a request can still keep (request_state.within_budget); off only
    # where a test needs drafts verified at a request's last tokens
    token_budget: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SchedulerConfigError(f"scheduler mode '{self.mode}' is unknown; choose one of {MODES}")
        if self.fixed_length is not None and self.fixed_length < 0:
            raise SchedulerConfigError(f"fixed_length must be >= 0, got {self.fixed_length}")
        if not 0.0 <= self.threshold < 1.0:
            raise SchedulerConfigError(f"threshold must lie in [0, 1), got {self.threshold}")
        if self.pricing is not None and self.pricing not in PRICING:
            raise SchedulerConfigError(f"pricing '{self.pricing}' is unknown; choose one of {PRICING}")
        if self.confidence_temperatures is not None and min(self.confidence_temperatures) <= 0:
            raise SchedulerConfigError("confidence temperatures must be > 0")
        if self.drafting not in DRAFTING:
            raise SchedulerConfigError(f"drafting '{self.drafting}' is unknown; choose one of {DRAFTING}")
        if self.drafting == "tree" and self.mode not in ("dspark", "fixed"):
            raise SchedulerConfigError(f"tree drafting runs with mode 'dspark' or 'fixed', not '{self.mode}'")
        if self.prompt_lookup < 0:
            raise SchedulerConfigError(f"prompt_lookup must be >= 0 (0: off), got {self.prompt_lookup}")
        if self.lookup_tokens is not None and self.lookup_tokens < 1:
            raise SchedulerConfigError(f"lookup_tokens must be >= 1 (None: twice the block size), got "
                                       f"{self.lookup_tokens}")
        if self.tree_nodes < 0 or self.tree_top_k < 1:
            raise SchedulerConfigError(f"tree_nodes must be >= 0 and tree_top_k >= 1, got {self.tree_nodes}, "
                                       f"{self.tree_top_k}")

    @property
    def needs_drafts(self) -> bool:
        return self.mode != "off" and not (self.mode == "fixed" and self.fixed_length == 0)

    @property
    def padded(self) -> bool:
        """Whether verification is priced as padded [R, W] rows (`pricing` "padded", or None unresolved)."""
        return self.pricing != "packed"

    @property
    def overlaps_probes(self) -> bool:
        """Whether the drafting gate's probes draft on a worker (their drafts go unverified: padded pricing)."""
        return self.overlap_probes and self.padded

    @property
    def copies_prompts(self) -> bool:
        """Whether requests may verify prompt-lookup copies (modes `dspark` and `async`, chain drafting)."""
        return self.prompt_lookup > 0 and self.mode in ("dspark", "async") and self.drafting == "chain"

    @property
    def needs_cost_model(self) -> bool:
        """Modes that price verification with a step cost model (SPS)."""
        return self.mode in ("dspark", "async")


@dataclass(frozen=True)
class Decision:
    """One step's scheduling outcome (kept in the step stats)."""

    lengths: tuple[int, ...]  # ℓ_r draft tokens sent to verification, per request
    expected_accepts: float | None  # τ* for the chosen lengths (dspark mode)
    expected_throughput: float | None  # Θ* = τ*·SPS(B*) tokens/s as the cost model predicts
    considered: int  # candidates evaluated before stopping (dspark mode)


def survival(confidence_logits: torch.Tensor, temperatures: tuple[float, ...] | None = None) -> torch.Tensor:
    """[R, γ] pre-sigmoid confidences -> [R, γ] prefix survival a_{r,j} = Π_{i≤j} σ(c_{r,i} / T_i)."""
    return torch.from_numpy(survival_array(np.asarray(confidence_logits, dtype=np.float64), temperatures))


def survival_array(confidence_logits: np.ndarray, temperatures: tuple[float, ...] | None = None) -> np.ndarray:
    """`survival` in numpy, float64 (the engine's every step; timed in place, 29 µs a step against torch's 35)."""
    logits = np.asarray(confidence_logits, dtype=np.float64)
    if temperatures is not None:
        if len(temperatures) < logits.shape[1]:
            raise SchedulerConfigError(
                f"{len(temperatures)} confidence temperatures for a block of {logits.shape[1]} slots"
            )
        logits = logits / _temperature_array(tuple(temperatures), logits.shape[1])
    return np.cumprod(np.exp(-np.logaddexp(0.0, -logits)), axis=1)  # σ(x) = exp(-log(1 + e^-x)): no overflow


@functools.lru_cache(maxsize=64)
def _temperature_array(temperatures: tuple[float, ...], slots: int) -> np.ndarray:
    """The first `slots` temperatures as float64 (read-only, shared: made once, not every step)."""
    array = np.asarray(temperatures[:slots], dtype=np.float64)
    array.flags.writeable = False
    return array


class ThroughputRule:
    """Algorithm 1's admission test: admit a candidate of survival `a` iff it raises Θ(τ, B);
    the caller stops at the first refusal. Starts from B = R verified roots and τ = R."""

    def __init__(self, requests: int, throughput: Throughput) -> None:
        self.throughput, self.tokens, self.tau = throughput, requests, float(requests)
        self.best = self._theta(self.tau, requests) if requests else 0.0

    def _theta(self, tau: float, tokens: int) -> float:
        return float(self.throughput(np.array([tau]), np.array([tokens]))[0])

    def admit(self, a: float) -> bool:
        theta = self._theta(self.tau + a, self.tokens + 1)
        if a <= 0.0 or theta <= self.best:
            return False
        self.best, self.tau, self.tokens = theta, self.tau + a, self.tokens + 1
        return True


def admit_by_throughput(survivals: Sequence[Sequence[float]] | np.ndarray, throughput: Throughput) -> Decision:
    """Algorithm 1 over rows of candidates: survivals[r][j] of request r's j-th candidate (chain slot
    or best-first tree node), non-increasing along each row (ragged rows, or an [R, γ] array).
    Candidates with a > 0 are taken by descending survival (ties: request, then position, so a
    request's candidates stay in prefix order) and admitted while Θ rises; the first refusal stops
    the scan. -> lengths[r] = admitted prefix of row r, τ, Θ, candidates considered.

    Vectorised: one sort, one cumulative sum and one Θ evaluation over every candidate, then the
    first drop. The cumulative sum adds in the same order as a one-by-one scan, so the decisions
    are the scalar scan's, bit for bit (tests/test_scheduler_vectorised.py)."""
    if isinstance(survivals, np.ndarray):
        rows, cols = np.nonzero(survivals > 0)
        values = survivals[rows, cols].astype(np.float64)
        requests = survivals.shape[0]
    else:
        pairs = [(r, j, a) for r, row in enumerate(survivals) for j, a in enumerate(row) if a > 0]
        rows = np.array([p[0] for p in pairs], dtype=np.int64)
        cols = np.array([p[1] for p in pairs], dtype=np.int64)
        values = np.array([p[2] for p in pairs], dtype=np.float64)
        requests = len(survivals)
    lengths = np.zeros(requests, dtype=np.int64)
    best = float(throughput(np.array([float(requests)]), np.array([requests]))[0]) if requests else 0.0
    if values.size == 0:
        return Decision(tuple(lengths.tolist()), float(requests), best, 0)
    order = np.lexsort((cols, rows, -values))  # descending survival, then request, then position
    a = values[order]
    tau = np.cumsum(np.concatenate(([float(requests)], a)))[1:]  # τ after admitting each candidate
    tokens = requests + np.arange(1, a.size + 1)
    theta = throughput(tau, tokens)
    previous = np.concatenate(([best], theta[:-1]))
    refused = np.flatnonzero(theta <= previous)
    admitted = int(refused[0]) if refused.size else a.size
    considered = admitted + 1 if refused.size else a.size
    np.maximum.at(lengths, rows[order[:admitted]], cols[order[:admitted]] + 1)
    if admitted:
        return Decision(tuple(lengths.tolist()), float(tau[admitted - 1]), float(theta[admitted - 1]), considered)
    return Decision(tuple(lengths.tolist()), float(requests), best, considered)


def admit_by_width(survivals: np.ndarray, throughput: Throughput) -> Decision:
    """Algorithm 1 for a padded verification: every request verifies W - 1 drafts, since [R, W] rows
    cost R·W tokens whoever fills them. Depth d (all requests' d-th drafts) adds τ_d = Σ_r a_{r,d}
    for R more tokens; depths are admitted in order while Θ = τ·SPS(R·W) rises, and the first drop
    stops the scan. Lossless by Algorithm 1's argument with candidates grouped by depth: admitting
    depth d reads survivals of depths ≤ d only, and a_{r,d} depends on drafts before slot d, never on
    the d-th draft itself (Appendix A). survivals [R, γ], non-increasing along γ."""
    requests, gamma = survivals.shape
    # τ and Θ from no draft (depth 0: the R anchors) to all γ depths, in one pricing call; the γ + 1 sums and
    # the scan in Python floats (numpy's cumsum adds in the same order), without numpy's per-call cost (~3 µs a
    # call with the caches cold from the graphs: one row's sums, which are its survivals, read as they are)
    sums = survivals[0].tolist() if requests == 1 else survivals.sum(axis=0).tolist()
    tau, total = [float(requests)], 0.0
    for a in sums:
        total += a
        tau.append(requests + total)
    theta = throughput(np.array(tau), _widths(requests, gamma)).tolist()
    depth = 0  # (survivals are >= 0: a depth's sum is > 0 where any row's survival is)
    while depth < gamma and theta[depth + 1] > theta[depth] and sums[depth] > 0:
        depth += 1
    # no row past its own drafts (a DSpark row beside a longer prompt-lookup copy has γ of the copy's width): a
    # sampled row's rejection rule reads the law its drafts were drawn from, which a padding token never had
    lengths = ((depth,) * requests if depth == 0 or requests == 1 or survivals[:, depth - 1].all()
               else tuple(np.minimum((survivals > 0).sum(axis=1), depth).tolist()))
    return Decision(lengths, tau[depth], theta[depth], min(depth + 1, gamma))


@functools.lru_cache(maxsize=256)
def _widths(requests: int, gamma: int) -> np.ndarray:
    """R·(1 + depth) for depths 0..γ: the tokens an [R, W] verification computes (read-only, shared)."""
    widths = requests * (1 + np.arange(gamma + 1))
    widths.flags.writeable = False
    return widths


def prefix_schedule(survival_probs: torch.Tensor | np.ndarray, step_seconds: StepSeconds, *,
                    padded: bool = False) -> Decision:
    """Algorithm 1 over chain slots. survival_probs [R, γ], non-increasing along γ.
    Θ = τ·SPS(B) with SPS(B) = 1 / step_seconds(R, B); B counts the verified tokens packed (the
    paper's §5.3, `admit_by_throughput`), or with `padded` what a verification over [R, W] rows
    computes (`admit_by_width`)."""
    requests = survival_probs.shape[0]
    admit = admit_by_width if padded else admit_by_throughput
    probs = survival_probs.numpy() if isinstance(survival_probs, torch.Tensor) else survival_probs
    return admit(probs, lambda tau, tokens: tau / step_seconds(requests, tokens))


def threshold_length(confidence_logits: torch.Tensor, threshold: float) -> int:
    """Index of the first slot whose confidence σ(c_k) falls below `threshold` (per position, not
    cumulative, as DeepSpec's static threshold does), or every slot if none does; every slot when
    threshold <= 0. confidence_logits [γ]."""
    if threshold <= 0.0:
        return confidence_logits.shape[0]
    below = (torch.sigmoid(confidence_logits) < threshold).nonzero()
    return int(below[0]) if below.numel() else confidence_logits.shape[0]


class StepScheduler:
    """The engine's scheduler: one per engine, asked once per step. Synchronous modes are the
    stateless `schedule`; a stateful mode keeps what it learns from earlier steps here (`async`:
    the capacities its searches found, see async_scheduler.py)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._async = None
        if config.mode == "async":
            from .async_scheduler import AsyncScheduler  # imports this module

            self._async = AsyncScheduler(config.confidence_temperatures, padded=config.padded)

    def survivals(self, confidence_logits: np.ndarray | None) -> np.ndarray | None:
        """[R, γ] this step's survivals at the configured temperatures, computed once for every reader of the
        step (Algorithm 1 and the drafting gate); None without confidences or in a mode that prices nothing."""
        if confidence_logits is None or self.config.mode not in ("dspark", "async"):
            return None
        return survival_array(confidence_logits, self.config.confidence_temperatures)

    def capacity(self, requests: int) -> int | None:
        """At most how many draft tokens the next `decide` admits for `requests` rows, known before
        its drafts exist (mode `async` once warmed up); None when only the drafts can tell."""
        return None if self._async is None else self._async.capacity(requests)

    def decide(
        self,
        *,
        requests: int,
        block_size: int,
        confidence_logits: torch.Tensor | None,  # [R, γ] or None
        step_seconds: StepSeconds | None,
        survivals: np.ndarray | None = None,  # [R, γ] survival(confidence_logits) where the caller has it
    ) -> Decision:
        if self._async is not None:
            return self._async.decide(confidence_logits=confidence_logits, step_seconds=step_seconds,
                                      survivals=survivals)
        return schedule(self.config, requests=requests, block_size=block_size,
                        confidence_logits=confidence_logits, step_seconds=step_seconds, survivals=survivals)


def schedule(
    config: SchedulerConfig,
    *,
    requests: int,
    block_size: int,
    confidence_logits: torch.Tensor | None,  # [R, γ] or None (drafter without confidence head)
    step_seconds: StepSeconds | None,
    survivals: np.ndarray | None = None,  # [R, γ] survival(confidence_logits, its temperatures), if known
) -> Decision:
    if config.mode == "off":
        return Decision((0,) * requests, None, None, 0)
    if config.mode == "fixed":
        k = block_size if config.fixed_length is None else min(config.fixed_length, block_size)
        return Decision((k,) * requests, None, None, 0)
    if confidence_logits is None and (survivals is None or config.mode != "dspark"):
        raise SchedulerConfigError(f"scheduler mode '{config.mode}' needs a drafter with a confidence head")
    if config.mode == "threshold":
        lengths = tuple(threshold_length(row, config.threshold) for row in torch.as_tensor(confidence_logits))
        return Decision(lengths, None, None, 0)
    if config.mode == "async":
        raise SchedulerConfigError("scheduler mode 'async' keeps state across steps: ask a StepScheduler")
    if step_seconds is None:
        raise SchedulerConfigError("scheduler mode 'dspark' needs a step cost model")
    if survivals is None:
        survivals = survival(confidence_logits, config.confidence_temperatures).numpy()
    return prefix_schedule(survivals, step_seconds, padded=config.padded)
