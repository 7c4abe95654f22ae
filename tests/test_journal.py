"""Request snapshots and the journal: frames that survive a torn tail and a damaged middle, the journal
store's records and compaction, and an engine resumed from snapshots that gives exactly the uninterrupted
run's tokens (greedy and seeded sampling, Algorithm 1 over the same batch)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from test_serving_support import tiny_pair, tiny_runtime

from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.drafting_gate import GatePlan
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.recovery.engine_state import (
    EngineStateWriter,
    engine_state,
    is_short_state,
    merge_engine_state,
    restore_engine_state,
)
from dspark.runtime.recovery.framing import HEADER_SIZE, frame, scan
from dspark.runtime.recovery.journal import JournalError, JournalStore
from dspark.runtime.recovery.recorder import StepRecorder
from dspark.runtime.recovery.snapshot import Finished, MemoryStore, Progress, RequestSnapshot, RequestSpec
from dspark.runtime.requests import RequestError

REQUESTS = [([5, 6, 7, 8], 0.0, 0), ([9, 10, 11], 1.0, 3), ([20, 21, 22, 23, 24], 0.8, 5), ([1, 2], 1.2, 9),
            ([30, 31, 32], 0.0, 1)]
MAX_NEW = 32


def test_frames_keep_every_whole_record_around_damage():
    payloads = [bytes([i]) * (10 + i) for i in range(6)]
    frames = [frame(p) for p in payloads]
    data = bytearray(b"".join(frames))
    middle = sum(len(f) for f in frames[:2]) + 14  # a payload byte of record 2
    data[middle] ^= 0xFF
    torn = bytes(data[:-5])  # the last record cut short
    found = scan(torn)
    assert found.payloads == [payloads[i] for i in (0, 1, 3, 4)]
    assert [d.reason for d in found.damage] == ["corrupt", "truncated"]
    assert found.damage[0].offset == sum(len(f) for f in frames[:2]) and found.damage[0].length == len(frames[2])
    assert scan(b"".join(frames)).damage == []


def _spec(i: int, temperature: float = 1.0) -> RequestSpec:
    return RequestSpec(f"req-{i}", [1, 2, 3], 50, temperature, i, [0], ["\n\n"], {"body": "{}"})


def _write(directory, steps: int = 6, **options) -> MemoryStore:
    """The same records into a journal and into a MemoryStore (the expected state)."""
    journal, expected = JournalStore(directory, **options), MemoryStore()
    journal.recover()
    for store in (journal, expected):
        for i in range(3):
            store.submitted(_spec(i, temperature=0.0 if i == 2 else 1.0))
        for step in range(steps):
            progress = [Progress(f"req-{i}", 2 * step, [step, i], [2], [3], step + i) for i in range(3)]
            store.stepped(step, progress, [Finished("req-1", list(range(2 * step + 2)), "stop", [2], [3])]
                          if step == steps - 2 else [])
    journal.close()
    return expected


def _state(recovered):
    return ([(s.spec, s.tokens, s.backlog, s.step, s.acceptance_lengths) for s in recovered.running],
            [(s.spec.key, s.tokens, s.finish_reason) for s in recovered.finished])


def test_journal_recovers_what_was_recorded_and_compacts(tmp_path):
    expected = _write(tmp_path, segment_bytes=600)  # small segments: compaction runs while recording
    journal = JournalStore(tmp_path)
    recovered = journal.recover()
    assert _state(recovered) == _state(expected.recover()) and not recovered.problems
    assert [s.spec.key for s in recovered.running] == ["req-0", "req-2"]
    assert len(list(tmp_path.glob("journal-*.dsj"))) == 1
    with pytest.raises(JournalError, match="in use by another server"):
        JournalStore(tmp_path)
    journal.close()
    again = JournalStore(tmp_path)
    assert _state(again.recover()) == _state(expected.recover())  # a compacted journal reads back the same
    again.close()


def test_corrupt_journal_keeps_every_whole_record(tmp_path):
    _write(tmp_path, fsync="step")
    (segment,) = tmp_path.glob("journal-*.dsj")
    data = bytearray(segment.read_bytes())
    data[_step_frame(data, 3) + HEADER_SIZE + 20] ^= 0x01  # step 3's record: its checksum no longer holds
    segment.write_bytes(bytes(data[:-7]))  # and the last record torn
    journal = JournalStore(tmp_path)
    recovered = journal.recover()
    journal.close()
    damage = [p for p in recovered.problems if p.startswith("journal ")]
    assert len(damage) == 2 and "is corrupt" in damage[0] and "torn last write" in damage[1]
    running = {s.spec.key: s for s in recovered.running}
    assert set(running) == {"req-0", "req-2"} and [s.spec.key for s in recovered.finished] == ["req-1"]
    for key in running:  # steps 0-2 whole, step 3 lost: each resumes after step 2
        assert running[key].tokens == [t for step in range(3) for t in (step, int(key[-1]))]
        assert running[key].step == 2 and any(f"request {key}: a step record is missing" in p
                                              for p in recovered.problems)
    assert running["req-0"].backlog == 2
    assert list(tmp_path.glob("*.corrupt")), "the damaged segment is kept for inspection"


def _step_frame(data: bytes | bytearray, step: int) -> int:
    """The offset of the frame that holds that engine step's record."""
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack_from("<I", data, pos + 4)
        payload = pos + HEADER_SIZE
        if data[payload : payload + 1] == b"Q" and struct.unpack_from("<q", data, payload + 1)[0] == step:
            return pos
        pos = payload + length
    raise AssertionError(f"no record of step {step}")


def test_bad_snapshots_are_refused():
    spec = _spec(0)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        from dspark.runtime.recovery.resume import resumed_tokens
        resumed_tokens(RequestSnapshot(spec, [1, 10**6]), 512, 50)
    with pytest.raises(RequestError, match="it had finished"):
        resumed_tokens(RequestSnapshot(spec, [1, 2, 3]), 512, 3)


class DearDrafting:
    """A split cost under which drafting never pays: the drafting gate skips, and every 16 steps probes the
    4 rows with the smallest backlogs, so which rows draft (and what a sampled row draws) depends on the
    gate's state and the backlogs."""

    def draft_seconds(self, requests: int) -> float:
        return 1.0 * requests

    def verify_seconds(self, requests: int, tokens):
        return 1e-3 + 1e-4 * tokens

    def seconds(self, requests: int, tokens):
        return self.draft_seconds(requests) + self.verify_seconds(requests, tokens)


@pytest.fixture(scope="module", params=["plain", "gated"])
def runtime(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("journal")
    if request.param == "plain":
        with tiny_runtime(root) as rt:
            yield rt
        return
    options = RuntimeOptions(scheduler=SchedulerConfig(), max_requests=8, max_seq_len=128, live_cost=False)
    with Runtime.from_checkpoints(*tiny_pair(root), options, cost_model=DearDrafting()) as rt:
        yield rt


def _run(runtime, kill_after: int | None, journal=None) -> dict[str, tuple[list[int], list[int]]]:
    """Every request's (tokens, acceptance lengths); with `kill_after`, the engine is dropped after that many
    steps and a fresh one continues from the store's snapshots alone. `journal`: a directory whose journal is
    the store, compacted after nearly every step (its running tokens then come from the recorder), closed at
    the kill and read back by a fresh JournalStore."""
    engine = runtime.engine()
    if journal is None:
        store = MemoryStore()
    else:
        store = JournalStore(journal, segment_bytes=200)
        store.recover()
    gated = isinstance(runtime.cost_model, DearDrafting)
    assert (engine.gate is not None) == gated
    max_new = 44 if gated else MAX_NEW  # gated: past the gate's third probe (step 34), after the kill at 20
    recorder = StepRecorder(store)
    keys = {}
    for i, (prompt, temperature, seed) in enumerate(REQUESTS):
        spec = RequestSpec(f"r{i}", prompt, max_new, temperature, seed)
        store.submitted(spec)
        keys[engine.submit(prompt, max_new_tokens=max_new, temperature=temperature, seed=seed)] = spec.key
        recorder.track(next(reversed(keys)), spec.key)
    out, steps, killed = {}, 0, False
    while not engine.idle:
        engine.step()
        steps += 1
        done = engine.take_finished()
        recorder.record(engine, done)
        out.update({keys[r]: (v.tokens, v.acceptance_lengths) for r, v in done.items()})
        if steps == kill_after:
            if journal is not None:
                store.close()
                store = JournalStore(journal)
            recovered = store.recover()
            ids = {key: request_id for request_id, key in keys.items()}
            for snap in recovered.running:  # every committed token is in the store, none beyond
                assert snap.tokens == engine.tokens_so_far(ids[snap.spec.key])
            assert {s.spec.key for s in recovered.running} | set(out) == {f"r{i}" for i in range(len(REQUESTS))}
            engine, keys, recorder = runtime.engine(), {}, StepRecorder(store)
            for snap in recovered.running:
                s = snap.spec
                keys[engine.submit(s.prompt_ids, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                   seed=s.seed, resume_from=snap)] = s.key
                recorder.track(next(reversed(keys)), s.key, len(snap.tokens), len(snap.acceptance_lengths))
            assert restore_engine_state(engine, recovered.engine_state) is None
            killed = True
    assert killed or kill_after is None, "the run ended before the kill"
    store.close()
    return out


@pytest.fixture(scope="module")
def whole(runtime):
    return _run(runtime, None)


@pytest.mark.parametrize("when", ["first step", "later"])
def test_resumed_engine_gives_the_uninterrupted_tokens(runtime, whole, when):
    """Later: step 4 of ~8 (plain); step 20 of ~40 (gated: after the gate's second probe, mid-skip; its
    third probe picks the rows with the smallest backlogs, which a resumed engine must count as the dead
    one did)."""
    kill_after = 1 if when == "first step" else 20 if isinstance(runtime.cost_model, DearDrafting) else 4
    assert _run(runtime, kill_after) == whole  # every request, greedy and sampled, tokens and rounds alike


def test_a_compacting_journal_resumes_the_uninterrupted_tokens(runtime, whole, tmp_path):
    """Compaction writes the running requests as the recorder holds them (the journal keeps no copy per step)."""
    kill_after = 20 if isinstance(runtime.cost_model, DearDrafting) else 4
    assert _run(runtime, kill_after, journal=tmp_path) == whole


def test_engine_state_refuses_a_gate_of_another_shape(runtime):
    engine = runtime.engine()
    if engine.gate is None:
        assert engine_state(engine) is None and restore_engine_state(engine, b"x" * 32) is None
        return
    engine.gate.pool.append(engine.gate.prior)
    state = engine_state(engine)
    assert restore_engine_state(runtime.engine(), state) is None
    assert "does not fit" in restore_engine_state(runtime.engine(), state[:-3])


def test_engine_state_writer_sends_the_state_only_when_it_changed(runtime):
    engine = runtime.engine()
    if engine.gate is None:
        pytest.skip("this engine has no drafting gate")
    writer = EngineStateWriter()
    engine.gate.pool.append(engine.gate.prior)
    first = writer(engine)
    assert first is not None and writer(engine) is None  # unchanged: the store keeps the last one
    engine.gate.skipped += 1
    short = writer(engine)  # only the skipped count moved: a short state, merged into the last whole one
    assert is_short_state(short) and len(short) < len(first) and not is_short_state(first)
    assert merge_engine_state(first, short) == engine_state(engine)
    table = MemoryStore().table
    for state in (first, short):
        table.step(0, [], [], state)
    assert table.engine_state == engine_state(engine)
    assert "does not fit" in restore_engine_state(runtime.engine(), short)  # alone it restores nothing
    engine.gate.pool.append(engine.gate.prior)
    engine.gate.pool_version += 1
    engine.gate.record(GatePlan(1, np.arange(1), 1.0, 1.0), None, (5.0, 2))  # realised acceptance moved
    changed = writer(engine)
    fresh = runtime.engine()
    assert changed is not None and restore_engine_state(fresh, changed) is None
    assert (fresh.gate.expected_drafts, fresh.gate.accepted_drafts) == (5.0, 2.0)
    assert writer(engine) is None
    engine.gate.probe_interval = 64  # probes backed off: the interval goes with the state
    backed_off = writer(engine)
    assert is_short_state(backed_off) and restore_engine_state(fresh, merge_engine_state(changed, backed_off)) is None
    assert fresh.gate.probe_interval == 64
    older = runtime.engine()  # a state written before the sums existed: they start at zero
    assert restore_engine_state(older, changed[:-20]) is None and older.gate.expected_drafts == 0.0
    assert len(older.gate.pool) == len(engine.gate.pool)
    old = runtime.engine()  # one written before the probe interval was saved: probe_every
    old.gate.probe_interval = 3
    assert restore_engine_state(old, changed[:-4]) is None and old.gate.expected_drafts == 5.0
    assert old.gate.probe_interval == old.gate.probe_every


def test_packed_rows_write_the_frames_progress_does(tmp_path):
    """`stepped_rows` (a recorder's one-pass hot path) and `stepped` leave the same journal behind."""
    rows_journal = JournalStore(tmp_path / "rows")
    with pytest.raises(JournalError, match="follow"):
        rows_journal.stepped_rows(0, 0, [], [], [])
    expected = _write(tmp_path / "progress")
    rows_journal.recover()
    rows_journal.follow(lambda: [])
    for i in range(3):
        rows_journal.submitted(_spec(i, temperature=0.0 if i == 2 else 1.0))
    for step in range(6):
        rows, values = [], []
        for i in range(3):
            rows += (rows_journal.journal_id(f"req-{i}"), 2 * step, 2, 1, step + i)
            values += [step, i, 2, 3]
        finished = [Finished("req-1", list(range(2 * step + 2)), "stop", [2], [3])] if step == 4 else []
        rows_journal.stepped_rows(step, 3, rows, values, finished)
    rows_journal.close()
    got = JournalStore(tmp_path / "rows")
    assert got.recover() == expected.recover()
    got.close()


@pytest.mark.parametrize("every", [1, 2])
def test_the_journals_step_records_hold_every_rounds_lengths(runtime, tmp_path, every):
    """The recorder's packed rows read back from the journal's own step records (no compaction): each running
    request's tokens, acceptance and proposal lengths as the engine holds them. Recorded after every step, or
    every other step (then a row's record carries two rounds); the first step's rows carry a token and no round."""
    store = JournalStore(tmp_path)
    store.recover()
    engine, recorder, ids = runtime.engine(), StepRecorder(store), {}
    for i, (prompt, temperature, seed) in enumerate(REQUESTS):
        spec = RequestSpec(f"r{i}", prompt, MAX_NEW, temperature, seed)
        store.submitted(spec)
        ids[spec.key] = engine.submit(prompt, max_new_tokens=MAX_NEW, temperature=temperature, seed=seed)
        recorder.track(ids[spec.key], spec.key)
    done: dict = {}
    for step in range(1, 7):
        engine.step()
        done.update(engine.take_finished())
        if step % every == 0:
            recorder.record(engine, done)
            done = {}
    store.close()
    reopened = JournalStore(tmp_path)
    recovered = reopened.recover()
    reopened.close()
    live = {a.result.request_id: a.result for a in engine.active}
    assert recovered.problems == [] and recovered.running
    for snap in recovered.running:
        result = live[ids[snap.spec.key]]
        assert (snap.tokens, snap.acceptance_lengths, snap.proposal_lengths) == \
            (result.tokens, result.acceptance_lengths, result.proposal_lengths)
