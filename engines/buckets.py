"""Token-count buckets and the optimization-profile shapes built from them.

A bucket is an upper bound on the tokens one target call verifies in a step: B = Σ_r (1 + ℓ_r)
over the R requests of the batch (the padded call is [R, 1 + max ℓ], so the runtime asks for the
bucket of R · (1 + max ℓ)). Every bucket gets one TensorRT optimization profile in one engine,
and the SPS table is measured at each bucket.

Profile of bucket k with bound B_k, for the target graphs' symbolic dims:

    batch   min 1   opt max(1, B_k // opt_tokens)   max min(B_k, max_batch)
    tokens  min 1   opt opt_tokens                  max min(B_k, max_seq_len)
    past    min 0   opt max_seq_len // 2            max max_seq_len
    total   = past + tokens (min 1, opt and max summed)
    capacity fixed at max_seq_len; capacity_plus_tokens = max_seq_len + tokens

with opt_tokens = min(B_k, verify_width) and verify_width = 1 + γ (one anchor + a full block).
The drafter graphs get one profile (the largest bucket's batch range): context_tokens 1..max_seq_len
(opt 1 + γ), context_past like past, context_total and block_total summed the same way.
Every call [R, T] with R·T ≤ B_k, R ≤ max_batch and T ≤ max_seq_len fits the profile of the
smallest bucket ≥ R·T, which is how `dspark.export.engine_dir.bucket_for` picks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from dspark.export.contract import GraphSpec
from dspark.export.engine_dir import BucketError

DimRange = tuple[int, int, int]  # (min, opt, max)


def parse_buckets(text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8): positive, strictly increasing integers."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise BucketError(f"--buckets {text!r}: expected comma-separated integers such as 1,2,4,8") from None
    if any(v < 1 for v in values):
        raise BucketError(f"--buckets {text!r}: every bucket must be >= 1")
    if any(b <= a for a, b in pairwise(values)):
        raise BucketError(f"--buckets {text!r}: buckets must be strictly increasing")
    return values


def plan_buckets(max_batch_tokens: int, buckets: Sequence[int] | None = None) -> tuple[int, ...]:
    """The given buckets (checked against the limit), or powers of two up to `max_batch_tokens`
    with the limit itself as the last bucket."""
    if max_batch_tokens < 1:
        raise BucketError(f"--max-batch-tokens must be >= 1, got {max_batch_tokens}")
    if buckets:
        if buckets[-1] > max_batch_tokens:
            raise BucketError(f"bucket {buckets[-1]} exceeds --max-batch-tokens {max_batch_tokens}")
        return tuple(buckets)
    planned, b = [], 1
    while b < max_batch_tokens:
        planned.append(b)
        b *= 2
    return (*planned, max_batch_tokens)


@dataclass(frozen=True)
class ShapeLimits:
    max_batch: int  # requests per call
    max_seq_len: int  # cached positions per request (past / capacity)
    verify_width: int  # 1 + γ: the usual tokens per row when verifying


def dim_ranges(bucket: int, limits: ShapeLimits) -> dict[str, DimRange]:
    """(min, opt, max) of every symbolic target dim for one bucket (see the module docstring)."""
    if bucket < 1:
        raise BucketError(f"bucket must be >= 1, got {bucket}")
    cap = limits.max_seq_len
    opt_tokens = min(bucket, limits.verify_width, cap)
    tokens = (1, opt_tokens, min(bucket, cap))
    max_batch = min(bucket, limits.max_batch)
    batch = (1, min(max(1, bucket // opt_tokens), max_batch), max_batch)
    past = (0, cap // 2, cap)
    context = (1, min(limits.verify_width, cap), cap)
    block = limits.verify_width - 1
    return {
        "batch": batch,
        "tokens": tokens,
        "past": past,
        "total": (1, past[1] + tokens[1], past[2] + tokens[2]),
        "capacity": (cap, cap, cap),
        "capacity_plus_tokens": (cap + 1, cap + tokens[1], cap + tokens[2]),
        # drafter graphs: new context rows (a prompt at prefill, 1 + accepted drafts later)
        "context_tokens": context,
        "context_past": past,
        "context_total": (1, past[1] + context[1], past[2] + context[2]),
        "block_total": (1 + block, past[1] + context[1] + block, past[2] + context[2] + block),
    }


def profile_shapes(spec: GraphSpec, bucket: int, limits: ShapeLimits) -> dict[str, tuple[tuple[int, ...], ...]]:
    """{input name: (min shape, opt shape, max shape)} of `spec` for one bucket."""
    ranges = dim_ranges(bucket, limits)
    shapes = {}
    for t in spec.inputs:
        unknown = [d for d in t.dims if isinstance(d, str) and d not in ranges]
        if unknown:
            raise BucketError(f"graph '{spec.name}' input {t.name}: no profile rule for dims {unknown}")
        shapes[t.name] = tuple(
            tuple(d if isinstance(d, int) else ranges[d][i] for d in t.dims) for i in range(3)
        )
    return shapes
