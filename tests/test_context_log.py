"""The context rows of plain (declined) steps, logged once a step over the active rows and handed to each row when
it drafts or verifies drafts, or rows join (`context_log`): every request's drafter is fed each position's context
features exactly once, in order, as the target computes them, its backlog counts the logged rows all along, and
the log follows rows that move, drops finished ones and hands a swapped one its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_drafting_gate import CHEAP, DEAR, SplitCost
from test_drafting_gate_engine import engine_for, pair, prompts

from dspark.runtime import probe_spacing, prompt_lookup
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.context_log import ContextLog
from dspark.runtime.gate_plan import GatePlan
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.recovery.journal import JournalStore
from dspark.runtime.recovery.recorder import StepRecorder
from dspark.runtime.recovery.snapshot import RequestSpec
from dspark.runtime.request_state import RunningRequest
from dspark.runtime.stats import RequestResult
from dspark.runtime.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_thread", "probes_whatever_the_ceiling")


def target_features(sequence: list[int]) -> np.ndarray:
    """[n, F] the target's context features at every position of `sequence`, in one call."""
    target = pair()[0]
    with torch.no_grad():
        return target(torch.tensor([sequence]), torch.arange(len(sequence))[None]).context_features[0].numpy()


def record_feeding(engine: BatchEngine, monkeypatch) -> dict[int, list[np.ndarray]]:
    """request id -> the context chunks its drafter is fed, in order, from now on."""
    fed: dict[int, list[np.ndarray]] = {}
    draft = engine.drafter.draft

    def feeding(anchors, starts, contexts, rows=None, **options):
        ids = [engine.active[r].result.request_id for r in (range(len(engine.active)) if rows is None else rows)]
        for request_id, chunks in zip(ids, contexts, strict=True):
            fed.setdefault(request_id, []).extend(np.asarray(c) for c in chunks)
        return draft(anchors, starts, contexts, rows, **options)

    monkeypatch.setattr(engine.drafter, "draft", feeding)
    return fed


def run_feeding(monkeypatch) \
        -> tuple[dict[int, list[np.ndarray]], dict[int, tuple[list[int], int]], list[tuple[int, int, int]]]:
    """An engine whose gate drafts at 3 rows and declines at 5 (probing in line every probe_every steps), requests
    of different lengths joining and leaving at different steps -> the context chunks each request's drafter was
    fed, each request's sequence and prompt length, and for every active row after every step: (its backlog, its
    positions not fed to its drafter yet, its logged rows)."""
    monkeypatch.setattr(probe_spacing, "PROBE_SHARE", 1e9)
    engine, _ = engine_for(SplitCost(3.5e-4, 1e-4), slots=6)  # drafting pays at 3 rows, not at 6
    fed = record_feeding(engine, monkeypatch)
    p = list(prompts())
    arrivals = {0: [(p[0], 30), (p[1], 45), (p[2], 60), (p[6], 20), (p[7], 36)], 7: [(p[3], 25)],
                20: [(p[4], 40), (p[5], 50)]}
    rows, step = [], 0
    while step <= max(arrivals) or not engine.idle:
        for prompt, new in arrivals.get(step, []):
            engine.submit(list(prompt), max_new_tokens=new)
        engine.step()
        rows += [(a.backlog, a.start - sum(len(c) for c in fed.get(a.result.request_id, [])),
                  0 if a.logged is None else len(a.logged)) for a in engine.active]
        step += 1
    sequences = {i: ([*r.prompt_ids, *r.tokens], len(r.prompt_ids)) for i, r in engine.take_finished().items()}
    return fed, sequences, rows


def test_every_position_is_fed_once_in_order_as_the_target_computes_it(monkeypatch):
    fed, sequences, rows = run_feeding(monkeypatch)
    assert len(sequences) == 8 and len(fed) >= 4
    assert max(logged for *_, logged in rows) >= 8  # declined runs of steps long enough to log many rows
    past_prompt = 0
    for request_id, chunks in fed.items():
        given = np.concatenate(chunks)
        sequence, prompt = sequences[request_id]
        np.testing.assert_allclose(given, target_features(sequence[: len(given)]), rtol=1e-4, atol=1e-4)
        past_prompt += len(given) - prompt
    assert past_prompt > 100  # rows of plain steps fed, not only prompts


def test_a_rows_backlog_is_what_its_drafter_has_not_been_fed_logged_rows_included(monkeypatch):
    _, _, rows = run_feeding(monkeypatch)
    assert [backlog for backlog, _, _ in rows] == [unfed for _, unfed, _ in rows]
    assert sum(1 for *_, logged in rows if logged) > 50


def test_where_every_row_copies_after_declined_steps_the_log_is_handed_before_the_copies_rows(monkeypatch):
    """Prompt lookup: declined steps log their rows, then drafting pays and every row copies (no row drafts), then
    they draft: the rows of the copies' verification come after the logged ones, every position fed in order."""
    target, drafter = pair()
    engine = BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                         capacity=Capacity(4, 1 << 16, 1024), cost_model=CHEAP, kv_mode="concat",
                         scheduler=SchedulerConfig("dspark", prompt_lookup=1, overlap_probes=False))
    plan = engine.gate.plan

    def declining_some(backlogs):  # steps 2-5 declined, the others as the gate plans (CHEAP: every row drafts)
        if 2 <= engine.steps_run <= 5:
            return GatePlan(len(backlogs), np.arange(0), 0.0, 0.0, declined=True)
        return plan(backlogs)

    monkeypatch.setattr(engine.gate, "plan", declining_some)
    monkeypatch.setattr(prompt_lookup, "copies_pay", lambda *_: engine.steps_run == 6)  # then DSpark drafts again
    copied = []
    propose = engine.lookup.propose

    def proposing(active, room):
        copies = propose(active, room)
        copied.append((engine.steps_run, 0 if copies is None else len(copies.rows), len(active)))
        return copies

    monkeypatch.setattr(engine.lookup, "propose", proposing)
    fed = record_feeding(engine, monkeypatch)
    p = list(prompts())
    for prompt in (p[2] * 4, p[1] * 3):  # repeating: every row has a continuation to copy
        engine.submit(list(prompt), max_new_tokens=40)
    finished = engine.run_until_done()
    assert (6, 2, 2) in copied  # right after the declined steps, every row copied
    sequences = {i: [*r.prompt_ids, *r.tokens] for i, r in finished.items()}
    for request_id, chunks in fed.items():
        given = np.concatenate(chunks)
        assert len(given) > len(finished[request_id].prompt_ids) + 10  # fed the logged and the copies' rows too
        np.testing.assert_allclose(given, target_features(sequences[request_id][: len(given)]), rtol=1e-4, atol=1e-4)


def request(request_id: int) -> RunningRequest:
    return RunningRequest(RequestResult(request_id, [1, 2], [3]), 8, 0.0, frozenset(), None)


def features(step: int, active: list[RunningRequest]) -> np.ndarray:
    """[R, 2]: (request id, step) in each row, so that whose rows went where shows."""
    return np.array([[a.result.request_id, step] for a in active], dtype=np.float32)


def test_the_log_follows_rows_that_move_drops_finished_rows_and_hands_a_swapped_row_its_own():
    active = [request(i) for i in range(4)]
    log = ContextLog()
    for step in range(3):
        log.log(features(step, active), active)
    assert [a.backlog for a in active] == [3] * 4
    active[1].result.finish_reason = "stop"  # row 1 finishes: the last row moves into it
    log.vacate(1, active[1])
    active[1] = active.pop()
    for step in range(3, 5):
        log.log(features(step, active), active)
    swapped = active[0]  # row 0 is swapped out, unfinished: it takes its rows
    log.vacate(0, swapped)
    active[0] = active.pop()
    assert swapped.logged is None and np.concatenate(swapped.pending).tolist() == [[0, s] for s in range(5)]
    log.log(features(5, active), active)
    assert [a.backlog for a in active] == [6, 6]
    log.hand(active)
    for a in active:
        assert a.logged is None and a.backlog == 6
        assert np.concatenate(a.pending).tolist() == [[a.result.request_id, s] for s in range(6)]
    assert log.blocks is None


def test_the_log_ends_when_its_last_row_leaves():
    active = [request(0)]
    log = ContextLog()
    log.log(features(0, active), active)
    active[0].result.finish_reason = "length"
    log.vacate(0, active[0])
    assert log.blocks is None and active[0].logged is None and not active[0].pending


def test_the_journal_records_backlogs_with_their_logged_rows(tmp_path):
    """The recorder's packed rows carry each running request's backlog, logged rows included: a resumed engine's
    gate prices the catch-up the dead one would."""
    engine, _ = engine_for(DEAR, slots=4)  # declines: every step after the first probe logs
    store = JournalStore(tmp_path)
    store.recover()
    recorder, ids = StepRecorder(store), {}
    for i, prompt in enumerate(list(prompts())[:3]):
        spec = RequestSpec(f"r{i}", list(prompt), 40, 0.0, 0)
        store.submitted(spec)
        ids[spec.key] = engine.submit(list(prompt), max_new_tokens=40)
        recorder.track(ids[spec.key], spec.key)
    for _ in range(12):
        engine.step()
        recorder.record(engine, engine.take_finished())
    store.close()
    reopened = JournalStore(tmp_path)
    recovered = reopened.recover()
    reopened.close()
    live = {a.result.request_id: a for a in engine.active}
    assert all(a.logged for a in live.values())  # the backlogs below include logged rows
    assert sorted((snap.spec.key, snap.backlog) for snap in recovered.running) == \
        sorted((key, live[i].backlog) for key, i in ids.items())
