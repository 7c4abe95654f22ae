"""The fleet (the cluster ingress's EngineService-shaped view of its replicas) over two in-process engine
replicas behind stand-ins for Ray Serve's handles: outputs equal `Runtime.generate`, the 400 and 429 refusals,
the ledger after every end, and a replica dying before and during a request. No Ray: test_cluster_ray.py
runs the same pieces on a real local Ray cluster."""

from __future__ import annotations

import asyncio

import pytest
from conftest import golden_path
from test_serving_support import COST, tiny_pair

from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.capacity import CapacityError
from dspark.runtime.cluster.fleet import Fleet, FleetFull
from dspark.runtime.cluster.replica import EngineReplica, EngineSpec
from dspark.runtime.cluster.routing import Router
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.requests import RequestError
from dspark.runtime.serving.handle import RequestFailed

OPTIONS = RuntimeOptions(scheduler=SchedulerConfig("dspark"), max_requests=4, max_seq_len=256, live_cost=False)
MAX_QUEUE = 4


class ActorDied(RuntimeError):
    """Stands in for ray.exceptions.ActorDiedError."""


class _Call:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class LocalHandle:
    """The DeploymentHandle calls the fleet makes, on an in-process EngineReplica; `kill()` makes every later
    call, and the replica's stream to the ingress, fail as a dead actor's do."""

    def __init__(self, replica: EngineReplica) -> None:
        self.replica, self.dead = replica, False
        self.describe, self.load = _Call(self._unary(replica.describe)), _Call(self._unary(replica.load))
        self.metrics_text = _Call(self._unary(replica.metrics_text))
        self.subscribe, self.cancel = _Call(self._subscribe), _Call(self._cancel)
        self.start = _Call(lambda *a, **k: asyncio.ensure_future(self._start(*a, **k)))  # sent at once, as Ray's
        self.sent = 0

    def options(self, stream: bool = False) -> LocalHandle:
        return self

    def kill(self) -> None:
        self.dead = True

    def _unary(self, fn):
        async def call():
            if self.dead:
                raise ActorDied("the actor died")
            return fn()

        return call

    async def _start(self, *args, **kwargs):
        if self.dead:
            raise ActorDied("the actor died")
        self.sent += 1
        return await self.replica.start(*args, **kwargs)

    def _cancel(self, *args):
        if self.dead:
            raise ActorDied("the actor died")
        return self.replica.cancel(*args)

    async def _subscribe(self):
        if self.dead:
            raise ActorDied("the actor died")
        stream = self.replica.subscribe()
        try:
            async for item in stream:
                if self.dead:
                    raise ActorDied("the actor died unexpectedly before finishing this task")
                yield item
        finally:
            await stream.aclose()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    target, drafter = tiny_pair(root)
    spec = EngineSpec(target_dir=str(target), drafter_dir=str(drafter), options=OPTIONS, cost_model=COST)
    replicas = [EngineReplica(spec, f"engine-{i}", max_queue=MAX_QUEUE, max_new_tokens=200) for i in range(2)]
    with Runtime.from_checkpoints(target, golden_path("qwen3-tiny-vanilla", "drafter"), OPTIONS,
                                  cost_model=COST) as rt:
        yield replicas, rt
    for replica in replicas:
        replica.close()


def run(pair, scenario, policy="round_robin"):
    """scenario(fleet, handles, rt) on a fresh fleet over the module's replicas."""
    replicas, rt = pair

    async def main():
        handles = [LocalHandle(r) for r in replicas]
        fleet = await Fleet.start([(r.name, h) for r, h in zip(replicas, handles, strict=True)], Router(policy),
                                  poll_interval=0.01)
        try:
            return await scenario(fleet, handles, rt)
        finally:
            fleet.close()

    return asyncio.run(main())


def expected(rt, prompt, temperature, seed, max_tokens):
    (result,) = rt.generate(prompt, max_new_tokens=max_tokens, temperature=temperature, seed=seed,
                            stop=list(rt.info.eos_token_ids))
    return result.tokens


CASES = [("def parse_args(", 0.0, 0), ("The quick brown", 0.0, 1), ("import os\n", 0.9, 7), ("for i in", 1.4, 8)]


def test_outputs_through_two_replicas_equal_runtime_generate(pair):
    async def scenario(fleet, handles, rt):
        outputs = []
        for prompt, temperature, seed in CASES:  # one at a time: each replica decodes it alone, as generate does
            request = fleet.submit(rt.encode(prompt), max_new_tokens=24, temperature=temperature, seed=seed,
                                   stop=list(rt.info.eos_token_ids))
            streamed = [t for tokens in [x async for x in request.astream()] for t in tokens]
            outputs.append((streamed, request.result(0)))
        return outputs, [h.sent for h in handles]

    outputs, sent = run(pair, scenario)
    rt = pair[1]
    for (streamed, whole), (prompt, temperature, seed) in zip(outputs, CASES, strict=True):
        (want,) = rt.generate(rt.encode(prompt), max_new_tokens=24, temperature=temperature, seed=seed,
                              stop=list(rt.info.eos_token_ids))
        assert streamed == want.tokens and whole.tokens == want.tokens
        assert (whole.finish_reason, whole.acceptance_lengths, whole.proposal_lengths) == (
            want.finish_reason, want.acceptance_lengths, want.proposal_lengths)
    assert sent == [2, 2]  # round-robin: both replicas served


def test_greedy_requests_at_once_equal_runtime_generate_and_the_ledger_empties(pair):
    prompts = [[5 + i, 40 + 3 * i, 17, 200 + i] for i in range(6)]

    async def scenario(fleet, handles, rt):
        requests = [fleet.submit(p, max_new_tokens=20, temperature=0.0) for p in prompts]
        assert sum(r.in_flight for r in fleet.replicas) == 6
        results = await asyncio.gather(*(r.aresult() for r in requests))
        return [r.tokens for r in results], [(r.in_flight, r.in_flight_work) for r in fleet.replicas]

    outputs, ledger = run(pair, scenario, policy="weighted")
    for tokens, prompt in zip(outputs, prompts, strict=True):
        assert tokens == expected(pair[1], prompt, 0.0, 0, 20)
    assert ledger == [(0, 0.0), (0, 0.0)]


def test_bad_requests_are_refused_before_routing(pair):
    async def scenario(fleet, handles, rt):
        with pytest.raises(CapacityError, match="slot holds"):
            fleet.submit(list(range(1, 250)), max_new_tokens=100)
        with pytest.raises(RequestError, match="exceeds this server's limit 200"):
            fleet.submit([1, 2, 3], max_new_tokens=201)
        with pytest.raises(RequestError):
            fleet.submit([1, 2, 10**6], max_new_tokens=4)
        service = handles[0].replica.service
        assert [fleet.room(n) for n in (1, 10, 60, 200, 250)] == [service.room(n) for n in (1, 10, 60, 200, 250)]
        return [h.sent for h in handles]

    assert run(pair, scenario) == [0, 0]


def test_when_every_queue_is_full_the_next_request_is_refused_then_taken_again(pair):
    held = 2 * (OPTIONS.max_requests + MAX_QUEUE)

    async def scenario(fleet, handles, rt):
        submitted = sum(h.replica.service.snapshot().submitted for h in handles)
        requests = [fleet.submit([7, 8, 9], max_new_tokens=200, temperature=0.0) for _ in range(held)]
        with pytest.raises(FleetFull, match="queue is full"):
            fleet.submit([7, 8, 9], max_new_tokens=4)
        for request in requests:
            request.cancel()  # before their starts reach the replicas: they never run there
        for _ in range(300):
            await asyncio.sleep(0.01)
            loads = [h.replica.service.snapshot() for h in handles]
            if all(load.running + load.queued == 0 for load in loads):
                break
        assert [(load.running, load.queued) for load in loads] == [(0, 0), (0, 0)]
        assert sum(load.submitted for load in loads) == submitted  # cancelled before their start: never run
        ledger = [(r.in_flight, r.in_flight_work) for r in fleet.replicas]
        taken = await fleet.submit([7, 8, 9], max_new_tokens=4, temperature=0.0).aresult()
        return ledger, taken.tokens, fleet.rejected

    ledger, tokens, rejected = run(pair, scenario, policy="weighted")
    assert ledger == [(0, 0.0), (0, 0.0)] and len(tokens) == 4 and rejected == 1


def test_a_replica_dying_fails_its_running_requests_and_reroutes_the_rest(pair):
    async def scenario(fleet, handles, rt):
        running = fleet.submit([11, 12, 13], max_new_tokens=200, temperature=0.0)  # round-robin: engine-0
        stream = running.astream()
        first = await stream.__anext__()
        assert running.replica == "engine-0" and first
        handles[0].kill()
        with pytest.raises(RequestFailed, match="engine replica engine-0 died during this request .* send it again"):
            async for _ in stream:
                pass
        unstarted = fleet.submit([21, 22, 23], max_new_tokens=12, temperature=0.0)  # turn of engine-1
        handles[1].kill()  # dies before this request's first token: it goes to engine-0 ... also dead
        with pytest.raises(RequestFailed, match="no engine replica could take this request"):
            await unstarted.aresult()
        handles[1].dead = False  # engine-1 back (as after Ray Serve's restart): the poll finds it
        for _ in range(200):
            if fleet.replicas[1].up:
                break
            await asyncio.sleep(0.01)
        results = [await fleet.submit([31 + i, 5], max_new_tokens=8, temperature=0.0).aresult() for i in range(3)]
        return results, [r.up for r in fleet.replicas], [(r.in_flight, r.in_flight_work) for r in fleet.replicas]

    results, up, ledger = run(pair, scenario)
    assert up == [False, True]
    for i, result in enumerate(results):  # all on the survivor
        assert result.tokens == expected(pair[1], [31 + i, 5], 0.0, 0, 8)
    assert ledger == [(0, 0.0), (0, 0.0)]


def test_a_request_whose_replica_dies_before_its_first_token_is_served_by_another(pair):
    async def scenario(fleet, handles, rt):
        request = fleet.submit([41, 42, 43], max_new_tokens=10, temperature=0.0)
        first = request.replica
        handles[0 if first == "engine-0" else 1].kill()
        result = await request.aresult()
        return first, request.replica, result.tokens

    first, last, tokens = run(pair, scenario)
    assert (first, last) == ("engine-0", "engine-1")
    assert tokens == expected(pair[1], [41, 42, 43], 0.0, 0, 10)


def test_a_stream_read_from_a_later_start_skips_what_the_reader_has(pair):
    """The app's `astream(start)` (a reconnecting reader) works on a fleet request as on a RequestHandle."""
    async def scenario(fleet, handles, rt):
        async def read(request, start):
            return [t for tokens in [x async for x in request.astream(start)] for t in tokens]

        requests = [fleet.submit([51, 52, 53], max_new_tokens=12, temperature=0.0) for _ in range(12)]
        live = dict(enumerate(await asyncio.gather(*(read(r, start) for start, r in enumerate(requests)))))
        request = requests[0]
        again = {start: await read(request, start) for start in range(13)}
        return live, again, request.tokens()

    live, again, tokens = run(pair, scenario)
    assert tokens == expected(pair[1], [51, 52, 53], 0.0, 0, 12)
    assert live == {start: tokens[start:] for start in range(12)}
    assert again == {start: tokens[start:] for start in range(13)}
