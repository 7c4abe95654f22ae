"""Moving a request whose replica died to another replica, the ingress's side: what to resume from, and how
the resumed stream joins what the client already has.

A resumed request's stream starts again at token 0 (the snapshot's committed tokens come first, then the new
ones), and the snapshot may be shorter than what the client has (the keeper lags the replica by the records
in flight when it died: snapshot_keeper.py). `splice` lays each update at its index: tokens the client has
must come back equal (greedy and seeded decoding are deterministic given the committed tokens), and only
those past them are delivered; a difference raises `Diverged`, which ends the request with an error rather
than send a wrong token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..recovery.snapshot import RequestSnapshot, RequestSpec
from ..stats import RequestResult


class Diverged(RuntimeError):
    """A resumed stream disagrees with what the client was sent (or skips past it)."""


def splice(have: Sequence[int], at: int, tokens: Sequence[int]) -> list[int]:
    """`tokens` are the request's output at indices at, at+1, ..; `have` what the client was sent. Returns the
    tokens past `have` (to deliver next); Diverged when one before differs from the client's or `at` leaves a
    gap after `have`."""
    if at > len(have):
        raise Diverged(f"the resumed stream starts at token {at} but the client has only {len(have)}: a gap")
    overlap = min(len(have) - at, len(tokens))
    for i in range(overlap):
        if tokens[i] != have[at + i]:
            raise Diverged(f"the resumed stream has token id {tokens[i]} at index {at + i} where the client was "
                           f"sent {have[at + i]}")
    return list(tokens[overlap:])


def fresh_snapshot(key: str, payload: dict[str, Any]) -> RequestSnapshot:
    """A snapshot with no tokens, from the request as the ingress sent it: what to resume from when the keeper
    has none (its submission record was lost with the replica); every token is decoded again and checked."""
    stop = payload.get("stop", ())
    spec = RequestSpec(key, list(payload["prompt_ids"]), payload["max_new_tokens"], float(payload["temperature"]),
                       payload["seed"], [s for s in stop if not isinstance(s, str)],
                       [s for s in stop if isinstance(s, str)])
    return RequestSnapshot(spec)


def finished_result(snapshot: RequestSnapshot) -> RequestResult:
    """The result of a request the keeper saw finish before its replica died."""
    return RequestResult(-1, list(snapshot.spec.prompt_ids), list(snapshot.tokens), list(snapshot.acceptance_lengths),
                         list(snapshot.proposal_lengths), snapshot.finish_reason or "")
