"""Probes drafted on the worker while the engine decodes on (runtime/probe_overlap.py): the steps really go on
beside a probe, it lands when due and before any row leaves, every step is learned once, and the blocks it
drafts are what a drafter fed the rows' whole context drafts. Greedy output through skips, probes and arrivals
with overlapped probes: tests/test_drafting_gate_engine.py, tests/test_async_gate.py, tests/test_device_kv.py."""

from __future__ import annotations

import math
import threading

import pytest
from test_drafting_gate import DEAR, SplitCost
from test_drafting_gate_engine import engine_for, greedy, launches, prompts, reference_drafts, run

from dspark.runtime import probe_spacing
from dspark.runtime.probe_overlap import MAX_FLIGHT_STEPS, WORKER_SLOWDOWN

pytestmark = pytest.mark.usefixtures("one_thread", "probes_whatever_the_ceiling")


def test_the_steps_go_on_while_a_probe_drafts():
    """The worker's drafter call waits until the target has run since the probe was launched: an engine that
    waited for its probe before verifying would never get there (the worker gives up after 30 s)."""
    engine, _ = engine_for(DEAR, overlap=True)
    backend = engine.backend
    target_calls, launched_at = [0], []
    progressed = threading.Condition()
    run_graph = backend._run

    def gated(graph, feeds):
        if threading.current_thread() is threading.main_thread():
            if graph.startswith("target"):
                with progressed:
                    target_calls[0] += 1
                    progressed.notify_all()
        elif graph.startswith("drafter"):
            with progressed:
                if not progressed.wait_for(lambda: target_calls[0] > launched_at[-1], timeout=30):
                    raise TimeoutError("the engine did not verify while its probe drafted")
        return run_graph(graph, feeds)

    backend._run = gated
    launch = engine._launch_probe

    def launching(*args):
        launched_at.append(target_calls[0])
        return launch(*args)

    engine._launch_probe = launching
    p = list(prompts())[:4]
    asked = run(engine, {0: p}, 16)
    finished = engine.take_finished()
    assert launched_at and len(engine.gate.pool) >= len(launched_at)  # probes ran and landed in the pool
    assert [finished[i].tokens for i in asked] == [greedy(q, 16) for q in asked.values()]


def test_a_probe_lands_when_due_and_before_any_row_leaves():
    engine, _ = engine_for(DEAR, overlap=True)
    p = list(prompts())
    ids = [engine.submit(list(q), max_new_tokens=40) for q in p[:4]]
    engine.step()  # the first step probes (no pool yet): on the worker, due MAX_FLIGHT_STEPS steps on (DEAR)
    probe = engine._probe
    assert probe is not None and probe.due == MAX_FLIGHT_STEPS and not engine.gate.pool
    while engine.steps_run < probe.due:
        engine.step()
        assert engine._probe is probe and not engine.gate.pool  # no second probe meanwhile
    engine.step()  # lands at the start of the step it is due
    assert engine._probe is None and len(engine.gate.pool) == 1
    engine.gate.probe_interval = engine.gate._probe_after = 0  # the next declined step probes again
    engine.step()
    assert engine._probe is not None
    engine.cancel(ids[1])  # a row leaves: the probe lands first, then the rows move
    assert engine._probe is None and len(engine.gate.pool) == 2
    done = engine.run_until_done()
    for i, q in zip(ids, p[:4], strict=True):
        if i != ids[1]:
            assert done[i].tokens == greedy(tuple(q), 40)


def test_an_engines_first_probe_lands_as_if_it_took_twice_its_price():
    """No probe has been timed yet: it lands when WORKER_SLOWDOWN times its price has passed in plain steps, not
    its bare price (which a cold first probe overran, and the step it landed in waited)."""
    cost = SplitCost(draft_per_request=1e-3, per_token=1e-4)  # a 1-row probe: 1 ms; a plain step's verify: 1.4 ms
    engine, _ = engine_for(cost, overlap=True)
    for q in list(prompts())[:4]:
        engine.submit(list(q), max_new_tokens=8)
    engine.step()
    probe = engine._probe
    plain = cost.verify_seconds(4, 4)
    assert probe is not None and probe.plan.price < plain < WORKER_SLOWDOWN * probe.plan.price
    assert probe.due == math.ceil(WORKER_SLOWDOWN * probe.plan.price / plain) == 2
    engine.run_until_done()


class ObservedCost(SplitCost):
    """The dear table, with a live model's `observe`: the records it is given."""

    def __init__(self) -> None:
        super().__init__(DEAR.draft_per_request, DEAR.per_token)
        self.observed: list = []

    def observe(self, record) -> None:
        self.observed.append(record)


def test_every_step_is_learned_once_the_probes_own_at_its_landing(monkeypatch):
    monkeypatch.setattr(probe_spacing, "PROBE_SHARE", 1e9)  # probes every probe_every steps
    cost = ObservedCost()
    engine, _ = engine_for(cost, overlap=True)
    launched = launches(engine)
    run(engine, {0: list(prompts())[:4]}, 40)
    assert len(launched) >= 2
    learned = [r.step for r in cost.observed]
    assert sorted(learned) == [s.step for s in engine.stats.steps if s.requests]  # each step once, none lost
    assert learned != sorted(learned)  # a probe's step is learned when it lands, steps after it was launched


@pytest.mark.parametrize("cost", [DEAR, SplitCost(4e-4, 1e-4)], ids=["skip-and-probe", "middle"])
def test_probes_on_the_worker_draft_what_a_drafter_fed_the_rows_whole_context_drafts(cost, monkeypatch):
    """Probe rows gathered from the slots after skipped steps, drafting beside the steps that add context rows
    to them: each drafted row's block is the reference block of its sequence as the probe was launched."""
    monkeypatch.setattr(probe_spacing, "PROBE_SHARE", 1e9)
    engine, _ = engine_for(cost, overlap=True)
    blocks, at_launch = [], []
    launch, propose = engine._launch_probe, engine._propose

    def launching(plan, *args):
        at_launch.append([[*a.result.prompt_ids, *a.result.tokens] for a in engine.active])
        return launch(plan, *args)

    def capture(drafting, *args):
        block = propose(drafting, *args)
        if threading.current_thread() is not threading.main_thread():
            blocks.append((at_launch[-1], block.tokens.copy(), drafting.tolist()))
        return block

    engine._launch_probe, engine._propose = launching, capture
    engine.gate.probe_rows = 2  # rows apart in the slots: their caches gathered and scattered on the worker
    p = list(prompts())
    run(engine, {0: p[:6], 3: [p[8]], 9: [p[2] * 3]}, 64)
    checked = 0
    for sequences, tokens, rows in blocks:
        for r in rows:
            assert tokens[r].tolist() == reference_drafts(sequences[r])
            checked += 1
    assert checked >= 6


def test_no_probe_leaves_the_step_while_a_row_samples(monkeypatch):
    """A sampled row's draws follow which steps drafted, which a resumed engine replays without a probe in flight:
    with one sampling row, probes stay in line."""
    monkeypatch.setattr(probe_spacing, "PROBE_SHARE", 1e9)
    engine, _ = engine_for(DEAR, overlap=True)
    launched = launches(engine)
    p = list(prompts())
    ids = [engine.submit(list(q), max_new_tokens=40, temperature=1.0 if i == 1 else 0.0, seed=i)
           for i, q in enumerate(p[:4])]
    done = engine.run_until_done()
    assert not launched and len(engine.gate.pool) >= 2  # probes ran, in their steps
    assert done[ids[0]].tokens == greedy(tuple(p[0]), 40) and len(done[ids[1]].tokens) == 40


def test_a_forked_child_gets_a_probe_worker_of_its_own():
    """The parent's worker thread does not exist in a forked child (a served engine's process may be forked):
    the child's first probe must not wait on it."""
    import multiprocessing

    from dspark.runtime.drafter_runner import probe_worker

    assert probe_worker().submit(int, 7).result() == 7  # the parent's worker exists
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        assert pool.apply_async(_probe_in_child).get(timeout=30) == 7


def _probe_in_child() -> int:
    from dspark.runtime.drafter_runner import probe_worker

    return probe_worker().submit(int, 7).result(timeout=10)


def test_a_probe_that_fails_on_the_worker_fails_its_landing_step_and_frees_the_gate():
    engine, _ = engine_for(DEAR, overlap=True)
    backend = engine.backend
    run_graph = backend._run

    def failing(graph, feeds):
        if threading.current_thread() is not threading.main_thread() and graph.startswith("drafter"):
            raise RuntimeError("drafter died")
        return run_graph(graph, feeds)

    backend._run = failing
    for q in list(prompts())[:4]:
        engine.submit(list(q), max_new_tokens=40)
    engine.step()  # launches the first probe
    assert engine._probe is not None
    with pytest.raises(RuntimeError, match="drafter died"):
        while True:
            engine.step()
    assert engine._probe is None and not engine.gate._in_flight
