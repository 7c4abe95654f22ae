"""What the engine records: per-request results and per-step decisions and timings."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the serving front end reads these records without numpy's import cost either
    import numpy as np


@dataclass
class RequestResult:
    request_id: int
    prompt_ids: list[int]
    tokens: list[int]  # generated ids, prompt excluded, truncated at max_new_tokens / stop
    acceptance_lengths: list[int] = field(default_factory=list)  # per round, bonus included
    proposal_lengths: list[int] = field(default_factory=list)  # drafts verified per round
    finish_reason: str = ""  # "length", "stop" or "cancelled"
    submitted_step: int = 0
    admitted_step: int = -1
    finished_step: int = -1

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(self.rounds, 1)

    @property
    def verified_tokens(self) -> int:
        """Tokens the target verified for this request: anchor + drafts, every round."""
        return sum(k + 1 for k in self.proposal_lengths)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(rounds=self.rounds, mean_acceptance_length=self.mean_acceptance_length,
                   verified_tokens=self.verified_tokens)
        return out


@dataclass
class StepRecord:
    step: int
    requests: int  # R active requests this step
    admitted_new: int  # requests prefilled this step
    lengths: list[int]  # ℓ_r per request (scheduler decision)
    verified_tokens: int  # B = Σ(1 + ℓ_r)
    padded_tokens: int  # what the target computed: R × (1 + max ℓ) padded, Σ(1 + ℓ_r) on the packed graph
    acceptance_lengths: list[int]  # per request: accepted drafts + the bonus token
    expected_accepts: float | None  # τ* (dspark mode)
    predicted_seconds: float | None  # cost model's t(R, B) for the decision (None: no rows drafted)
    seconds: dict[str, float]  # phase -> wall seconds (prefill, draft, heads, schedule, verify, commit)
    cpu_percent: float | None = None
    gpu_percent: float | None = None
    confidence_logits: np.ndarray | None = None  # [R, γ] pre-sigmoid (host), rows in active order
    drafted: bool = True  # False when the drafting gate judged drafting unprofitable this step
    copied_rows: tuple[int, ...] = ()  # rows that verified a prompt-lookup copy, not a DSpark block (prompt_lookup)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


class EngineStats:
    """The last `history` step records (None keeps all: benchmarks) and running totals over every
    step, so a long-lived engine's memory stays bounded while `summary` still covers its whole life."""

    def __init__(self, history: int | None = 1024) -> None:
        self.steps: deque[StepRecord] = deque(maxlen=history)
        self._totals = dict.fromkeys(("steps", "seconds", "committed", "verified", "padded", "rows", "copied"), 0.0)

    def record(self, step: StepRecord) -> None:
        self.steps.append(step)
        t = self._totals
        t["seconds"] += step.total_seconds
        if step.requests:
            t["steps"] += 1
            t["committed"] += sum(step.acceptance_lengths)
            t["verified"] += step.verified_tokens
            t["padded"] += step.padded_tokens
            t["rows"] += step.requests
            t["copied"] += len(step.copied_rows)

    def recent(self, count: int) -> list[StepRecord]:
        return list(self.steps)[-count:]

    def summary(self) -> dict[str, float]:
        t = self._totals
        return {
            "steps": int(t["steps"]),
            "seconds": t["seconds"],
            "committed_tokens": int(t["committed"]),
            "tokens_per_second": t["committed"] / t["seconds"] if t["seconds"] else 0.0,
            "verified_tokens": int(t["verified"]),
            "padded_tokens": int(t["padded"]),
            "padding_fraction": 1 - t["verified"] / t["padded"] if t["padded"] else 0.0,
            "mean_acceptance_length": t["committed"] / max(t["rows"], 1),
            "copied_row_fraction": t["copied"] / max(t["rows"], 1),  # request-steps that verified a copy
        }
