"""Two-tier KV: with two device slots and a host tier, six requests are all held at once, take turns on
the device, and give exactly the tokens of an engine with a slot for each (greedy, and sampled by seed
under the fixed scheduler); none is lost, cancelling a swapped-out one works."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_serving_support import tiny_runtime

from dspark.runtime.kv_tiers import HostTier

REQUESTS = [([5 + i, 6, 7, 8 + i], 0.0 if i % 2 == 0 else 1.0, i) for i in range(6)]
MAX_NEW = 32


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    with tiny_runtime(tmp_path_factory.mktemp("tiers"), scheduler="fixed", max_requests=2, max_seq_len=72) as rt:
        yield rt


def _run(runtime, slots: int, host: HostTier | None, cancel_swapped: bool = False):
    runtime.options = replace(runtime.options, max_requests=slots)
    engine = runtime.engine()
    engine.tiers = host
    ids = [engine.submit(p, max_new_tokens=MAX_NEW, temperature=t, seed=s) for p, t, s in REQUESTS]
    held, cancelled = 0, None
    while not engine.idle:
        engine.step()
        swapped = engine.tiers.requests() if engine.tiers else []
        held = max(held, len(engine.active) + len(swapped))
        if cancel_swapped and swapped and cancelled is None:
            cancelled = swapped[0].result.request_id
            seen = engine.tokens_so_far(cancelled)
            assert engine.cancel(cancelled) and engine.take_result(cancelled).tokens == seen
    done = engine.take_finished()
    return {i: done[i].tokens for i in ids if i != cancelled}, held, cancelled


@pytest.fixture(scope="module")
def wide(runtime):
    """A slot for every request: (outputs, requests held at once)."""
    outputs, held, _ = _run(runtime, 6, None)
    return outputs, held


def test_swapping_holds_more_requests_with_identical_outputs(runtime, wide):
    expected, held_wide = wide
    waiting, held_narrow, _ = _run(runtime, 2, None)
    host = HostTier(host_tokens=4 * 72, quantum=2)
    swapped, held_tiered, _ = _run(runtime, 2, host)
    assert waiting == expected and swapped == expected  # every request, greedy and sampled
    assert (held_wide, held_narrow, held_tiered) == (6, 2, 6)
    assert host.stats.swaps_out == host.stats.swaps_in > 0 and not host.swapped


def test_cancelling_a_swapped_out_request(runtime, wide):
    expected = wide[0]
    host = HostTier(host_tokens=4 * 72, quantum=2)
    rest, _, cancelled = _run(runtime, 2, host, cancel_swapped=True)
    assert cancelled is not None and rest == {i: t for i, t in expected.items() if i != cancelled}
    assert host.held_tokens == 0


def test_host_tier_bounds():
    with pytest.raises(ValueError, match="quantum"):
        HostTier(host_tokens=10, quantum=0)
