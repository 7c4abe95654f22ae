"""The snapshot keeper (a detached actor's body, here in process) and request migration off a dead replica:
the keeper's tables and claims, the ingress's splice of a resumed stream onto what the client has, and two
in-process replicas whose first dies mid-stream: its requests complete on the second, identical to
`Runtime.generate`, with no token twice and none missing, from a whole, a lagging or no snapshot; a resumed
stream that disagrees with what was delivered ends the request with an error. No Ray: test_cluster_ray.py
kills a real replica process."""

from __future__ import annotations

import asyncio
import pickle
import threading

import pytest
from conftest import golden_path
from test_cluster_fleet import OPTIONS, ActorDied, LocalHandle, _Call
from test_serving_support import COST, tiny_pair

from dspark.runtime.api import Runtime
from dspark.runtime.cluster.fleet import Fleet
from dspark.runtime.cluster.migration import Diverged, fresh_snapshot, splice
from dspark.runtime.cluster.replica import EngineReplica, EngineSpec
from dspark.runtime.cluster.routing import Router
from dspark.runtime.cluster.snapshot_keeper import KeeperStore, SnapshotKeeper
from dspark.runtime.recovery.snapshot import Finished, MemoryStore, Progress, RequestSpec
from dspark.runtime.serving.handle import RequestFailed


class LocalKeeper:
    """Stands in for the keeper's actor handle: each call's arguments and answer go through pickle (as Ray's
    do), calls are applied one at a time; `claim` answers an awaitable. `freeze(table)` drops that table's
    later records (the records a dying replica had not sent yet); `tamper` changes a claimed snapshot."""

    def __init__(self) -> None:
        self.body, self.lock = SnapshotKeeper(), threading.Lock()
        self.frozen: set[str] = set()
        self.tamper = None
        for name in ("submitted", "stepped", "adopted", "record", "drop", "recover", "stats"):
            setattr(self, name, _Call(self._sync(name)))
        self.claim = _Call(self._claim)

    def _sync(self, name):
        def call(table=None, *args):
            with self.lock:
                if name == "record" and table in self.frozen:
                    return None
                found = getattr(self.body, name)(*pickle.loads(pickle.dumps((table, *args))))
                return pickle.loads(pickle.dumps(found))

        return call

    async def _claim(self, table, key):
        with self.lock:
            found = pickle.loads(pickle.dumps(self.body.claim(table, key)))
        if found is not None and self.tamper is not None:
            self.tamper(found)
        return found


def _spec(key: str, temperature: float = 0.0) -> RequestSpec:
    return RequestSpec(key, [1, 2, 3], 50, temperature, 7)


def _progress(key: str, first: int, tokens: list[int]) -> Progress:
    return Progress(key, first, tokens, [len(tokens)], [4])


@pytest.mark.parametrize("background", [False, True])
def test_a_keeper_store_keeps_what_a_memory_store_keeps(background):
    keeper, expected = LocalKeeper(), MemoryStore()
    store = KeeperStore(keeper, "engine-0@a", background=background)
    for target in (store, expected):
        for i in range(3):
            target.submitted(_spec(f"r{i}"))
        for step in range(5):
            target.stepped(step, [_progress(f"r{i}", 2 * step, [step, i]) for i in range(3)],
                           [Finished("r1", list(range(10)), "stop", [2], [4])] if step == 3 else [])
    store.flush()
    got, want = store.recover(), expected.recover()
    assert [(s.spec, s.tokens, s.step) for s in got.running] == [(s.spec, s.tokens, s.step) for s in want.running]
    assert [(s.spec.key, s.tokens, s.finish_reason) for s in got.finished] == [("r1", list(range(10)), "stop")]
    assert store.sent_records == 8  # 3 submissions, 5 steps
    assert keeper.body.recover("engine-1@b").running == []  # tables are apart
    store.close()
    assert keeper.body.stats()["tables"] == 0  # a clean close drops the table


def test_a_claim_takes_a_request_once_and_later_records_of_it_are_ignored():
    keeper = SnapshotKeeper()
    keeper.submitted("t", _spec("a"))
    keeper.submitted("t", _spec("b"))
    keeper.stepped("t", 0, [_progress("a", 0, [5, 6]), _progress("b", 0, [9])], [])
    keeper.stepped("t", 1, [], [Finished("b", [9, 8], "stop", [1, 1], [4, 4])])
    claimed = keeper.claim("t", "a")
    assert claimed.tokens == [5, 6] and claimed.finish_reason is None
    assert keeper.claim("t", "a") is None  # resumed at most once
    keeper.submitted("t", _spec("a"))  # the dead replica's last records, arriving late (two callers: any order)
    keeper.stepped("t", 2, [_progress("a", 2, [7])], [])
    assert keeper.recover("t").running == [] and keeper.claim("t", "a") is None
    finished = keeper.claim("t", "b")
    assert (finished.tokens, finished.finish_reason) == ([9, 8], "stop")
    assert keeper.claim("gone", "x") is None
    keeper.adopted("u", claimed)  # the replica that took it over: its records continue the snapshot
    keeper.stepped("u", 0, [_progress("a", 2, [7, 1])], [])
    assert [s.tokens for s in keeper.recover("u").running] == [[5, 6, 7, 1]]
    with pytest.raises(ValueError, match="unknown snapshot record 'claim'"):
        keeper.record("u", [("claim", ("a",))])


def test_splice_delivers_only_tokens_past_the_client_and_checks_the_overlap():
    have = [10, 11, 12, 13]
    assert splice(have, 4, [14, 15]) == [14, 15]  # a plain continuation
    assert splice(have, 0, [10, 11]) == []  # all re-decoded, nothing new
    assert splice(have, 2, [12, 13, 14, 15]) == [14, 15]  # overlap, then new
    assert splice(have, 0, [10, 11, 12, 13, 14]) == [14]
    assert splice([], 0, [1, 2]) == [1, 2]
    with pytest.raises(Diverged, match="token id 99 at index 3 where the client was sent 13"):
        splice(have, 2, [12, 99, 14])
    with pytest.raises(Diverged, match="starts at token 5 but the client has only 4: a gap"):
        splice(have, 5, [15])
    snapshot = fresh_snapshot("k", dict(prompt_ids=[1, 2], max_new_tokens=9, temperature=0.5, seed=3,
                                        stop=[7, "\n\n"]))
    assert (snapshot.spec.stop_ids, snapshot.spec.stop_strings, snapshot.tokens) == ([7], ["\n\n"], [])


MAX_TOKENS = 150  # long enough that no stream ends before the kill


class KeeperHandle(LocalHandle):
    """LocalHandle with the replica's `adopt`."""

    def __init__(self, replica: EngineReplica) -> None:
        super().__init__(replica)
        self.adopt = _Call(lambda *a, **k: asyncio.ensure_future(self._adopt(*a, **k)))

    async def _adopt(self, *args):
        if self.dead:
            raise ActorDied("the actor died")
        self.sent += 1
        return await self.replica.adopt(*args)


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    target, drafter = tiny_pair(tmp_path_factory.mktemp("keeper"))
    spec = EngineSpec(target_dir=str(target), drafter_dir=str(drafter), options=OPTIONS, cost_model=COST)
    keeper = LocalKeeper()
    replicas = [EngineReplica(spec, f"engine-{i}", max_queue=4, max_new_tokens=200,
                              store=lambda table: KeeperStore(keeper, table)) for i in range(2)]
    with Runtime.from_checkpoints(target, golden_path("qwen3-tiny-vanilla", "drafter"), OPTIONS,
                                  cost_model=COST) as rt:
        yield replicas, keeper, rt
    for replica in replicas:
        replica.close()


def expected(rt, prompt, temperature, seed, max_tokens):
    (result,) = rt.generate(prompt, max_new_tokens=max_tokens, temperature=temperature, seed=seed,
                            stop=list(rt.info.eos_token_ids))
    return result.tokens


def migrate(kept, cases, *, freeze: bool = False, tamper=None, max_tokens: int = MAX_TOKENS,
            observed: dict | None = None):
    """`cases` (prompt, temperature, seed) streamed at once (round-robin: the first on engine-0); engine-0
    dies once each has delivered a token (with `freeze`, its table stops taking records once it holds a token,
    and the first client reads past what it holds). Returns each stream's chunks, its error (or None), the
    replicas that served it, and the fleet's counts; `observed` gets the first client's tokens at the kill."""
    replicas, keeper, rt = kept

    async def main():
        handles = [KeeperHandle(r) for r in replicas]
        fleet = await Fleet.start([(r.name, h) for r, h in zip(replicas, handles, strict=True)],
                                  Router("round_robin"), poll_interval=0.01, keeper=keeper)
        keeper.tamper = tamper
        try:
            requests = [fleet.submit(p, max_new_tokens=max_tokens, temperature=t, seed=s,
                                     stop=list(rt.info.eos_token_ids)) for p, t, s in cases]
            served = [{r.replica} for r in requests]
            streams = [r.astream() for r in requests]
            chunks = [[await s.__anext__()] for s in streams]
            if freeze:  # once the keeper holds a token of engine-0's request (its records are sent behind)
                while not any(s.tokens for s in keeper.recover.remote(replicas[0].table).running):
                    await asyncio.sleep(0.001)
                keeper.frozen.add(replicas[0].table)
                # what the keeper holds now is all it will hold (records are applied under its lock, and
                # later ones dropped); the client reads on past it: tokens the keeper never hears of
                held = max(len(s.tokens) for s in keeper.recover.remote(replicas[0].table).running)
                while sum(map(len, chunks[0])) <= held:
                    chunks[0].append(await streams[0].__anext__())
            if observed is not None:
                observed["client_tokens"] = sum(map(len, chunks[0]))
            handles[0].kill()

            async def rest(i):
                try:
                    async for c in streams[i]:
                        chunks[i].append(c)
                        served[i].add(requests[i].replica)
                except RequestFailed as exc:
                    return exc
                return None

            errors = await asyncio.gather(*(rest(i) for i in range(len(cases))))
            return chunks, errors, served, (fleet.migrated, fleet.diverged), [r.migrations for r in requests]
        finally:
            keeper.frozen.clear()
            fleet.close()

    try:
        return asyncio.run(main())
    finally:
        replicas[0].close()  # "dead": a fresh engine-0 for the next scenario
        replicas[0] = EngineReplica(replicas[0].spec, "engine-0", max_queue=4, max_new_tokens=200,
                                    store=lambda table: KeeperStore(keeper, table))


def test_a_dead_replicas_greedy_streams_complete_on_the_survivor(kept):
    cases = [([11, 12, 13], 0.0, 0), ([21, 22], 0.0, 0), ([31, 32, 33, 34], 0.0, 0), ([41], 0.0, 0)]
    chunks, errors, served, counts, moves = migrate(kept, cases)
    assert errors == [None] * 4
    for (prompt, t, s), got in zip(cases, chunks, strict=True):
        assert [x for c in got for x in c] == expected(kept[2], prompt, t, s, MAX_TOKENS)  # none twice or missing
    assert moves == [1, 0, 1, 0] and counts == (2, 0)
    assert served[0] == {"engine-0", "engine-1"} and served[1] == {"engine-1"}


@pytest.mark.parametrize("temperature,seed", [(0.9, 7), (1.4, 8)])
def test_a_seeded_sampled_stream_alone_completes_on_the_survivor_identically(kept, temperature, seed):
    """Alone on both replicas, as `Runtime.generate` decodes it (with `dspark`, the batch shares the drafts)."""
    chunks, errors, _, _, moves = migrate(kept, [([5, 6, 7, 8], temperature, seed)])
    assert errors == [None] and moves == [1]
    assert [x for c in chunks[0] for x in c] == expected(kept[2], [5, 6, 7, 8], temperature, seed, MAX_TOKENS)


def test_a_keeper_that_lags_the_client_costs_re_decoding_not_tokens(kept):
    claimed, observed = [], {}
    chunks, errors, _, _, moves = migrate(kept, [([51, 52, 53], 0.0, 0), ([61, 62], 0.0, 0)], freeze=True,
                                          tamper=lambda snapshot: claimed.append(len(snapshot.tokens)),
                                          observed=observed)
    assert errors == [None, None] and moves == [1, 0]
    assert 0 < claimed[0] < observed["client_tokens"]  # resumed from fewer tokens than the client had
    assert [x for c in chunks[0] for x in c] == expected(kept[2], [51, 52, 53], 0.0, 0, MAX_TOKENS)


def test_a_resumed_stream_that_disagrees_with_the_client_fails_without_a_wrong_token(kept):
    def tamper(snapshot):  # a committed token the client was sent differently; running, so it is resumed
        snapshot.tokens, snapshot.finish_reason = [(snapshot.tokens[0] + 1) % 100], None
        snapshot.acceptance_lengths, snapshot.proposal_lengths = [1], [1]

    chunks, errors, _, counts, _ = migrate(kept, [([71, 72, 73], 0.0, 0)], tamper=tamper)
    want = expected(kept[2], [71, 72, 73], 0.0, 0, MAX_TOKENS)
    got = [x for c in chunks[0] for x in c]
    assert got == want[: len(got)] and len(got) < len(want)
    assert "engine replica engine-1 after its replica died" in str(errors[0]) and "none of them wrong" in str(errors[0])
    assert counts == (1, 1)


def test_resume_checks_a_snapshot_in_the_callers_thread(kept):
    from dspark.runtime.recovery.snapshot import RequestSnapshot
    from dspark.runtime.requests import RequestError

    service = kept[0][1].service
    done = RequestSnapshot(_spec("x"), [1, 2], finish_reason="stop")
    with pytest.raises(RequestError, match="snapshot of x: it had finished"):
        service.resume(done)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        service.resume(RequestSnapshot(_spec("y"), [1, 10**6]))
    handle = service.resume(RequestSnapshot(_spec("z"), [4, 5]))  # 50 new tokens, 2 of them committed already
    result = handle.result(60)
    assert result.tokens[:2] == [4, 5] and len(result.tokens) == 50 and handle.key == "z"


def test_a_request_the_keeper_saw_finish_ends_from_its_finished_snapshot(kept):
    want = expected(kept[2], [81, 82], 0.0, 0, MAX_TOKENS)

    def finished(snapshot):  # as if its last step's record (its end) reached the keeper, its tokens not the client
        snapshot.tokens, snapshot.finish_reason = list(want), "length"

    chunks, errors, served, counts, moves = migrate(kept, [([81, 82], 0.0, 0)], tamper=finished)
    assert errors == [None] and moves == [1] and counts == (1, 0)
    assert [x for c in chunks[0] for x in c] == want and served[0] == {"engine-0"}  # not decoded again


def test_a_snapshot_its_replica_cancelled_is_resumed_not_replayed_as_its_end(kept):
    """A replica cancels a feed's requests when its stream to the ingress closes, and its store records that
    end: claimed after it, the request was replayed as ended ("cancelled", its few tokens so far), and the
    stream stopped short with no error (2 of 45 fresh runs of the greedy kill test under load)."""
    def cancelled(snapshot):  # as the dying replica's cancel recorded it: its tokens so far, ended "cancelled"
        snapshot.finish_reason = "cancelled"

    chunks, errors, served, counts, moves = migrate(kept, [([61, 62], 0.0, 0)], tamper=cancelled)
    assert errors == [None] and moves == [1] and counts == (1, 0)
    assert [x for c in chunks[0] for x in c] == expected(kept[2], [61, 62], 0.0, 0, MAX_TOKENS)
    assert "engine-1" in served[0]  # decoded on by the survivor


def test_a_finished_snapshot_that_disagrees_with_the_client_fails_without_a_wrong_token(kept):
    def finished(snapshot):  # its recorded end differs from what the client was sent at index 0
        want = expected(kept[2], [91, 92], 0.0, 0, MAX_TOKENS)
        snapshot.tokens, snapshot.finish_reason = [(want[0] + 1) % 100, *want[1:]], "length"

    chunks, errors, _, counts, _ = migrate(kept, [([91, 92], 0.0, 0)], tamper=finished)
    assert "its end as the snapshot keeper recorded it (engine replica engine-0 died)" in str(errors[0])
    assert counts == (1, 1) and len([x for c in chunks[0] for x in c]) > 0
