"""The engine service without HTTP: concurrent clients get exactly `Runtime.generate`'s outputs, cancel frees
the slot, the queue limit holds, a failing step ends only the requests in it, listeners cannot stop the loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import asdict

import pytest
from test_serving_support import COST, loop_breaking_runtime, tiny_opener, tiny_pair, tiny_runtime

from dspark.models import load_pair
from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.capacity import CapacityError
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.requests import RequestError
from dspark.runtime.serving.service import EngineService, QueueFull, RequestFailed, ServiceClosed
from dspark.runtime.torch_backend import TorchBackend

PROMPTS = [[67, 24, 319, 84, 473], [5, 6, 7], [100, 200, 300, 400, 8, 9, 10], [42], [7, 7, 7, 7]]
POISON = 499  # a token id the poisoned backend refuses in prefill


def collect(handle) -> list[int]:
    return [t for chunk in handle.stream(timeout=60) for t in chunk]


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def fixed_runtime(tmp_path_factory):
    """`fixed` γ: each request's sampling stream is its own whatever shares the batch, so sampled outputs are
    comparable token for token under concurrency (with `dspark`, the shared draft budget makes the sampled
    token sequence depend on the batch; its distribution does not)."""
    with tiny_runtime(tmp_path_factory.mktemp("fixed"), scheduler="fixed") as rt:
        yield rt


def test_concurrent_threads_and_tasks_get_runtime_generate_outputs(fixed_runtime):
    cases = [(p, t, seed) for p in PROMPTS for t, seed in ((0.0, 0), (0.9, 11), (1.3, 12))]
    expected = [fixed_runtime.generate(p, max_new_tokens=20, temperature=t, seed=s)[0].tokens for p, t, s in cases]
    with EngineService(fixed_runtime) as service:
        got: dict[int, list[int]] = {}

        def client(i: int) -> None:
            p, t, s = cases[i]
            got[i] = collect(service.submit(p, max_new_tokens=20, temperature=t, seed=s))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(0, len(cases), 2)]
        for thread in threads:
            thread.start()

        async def tasks() -> list[list[int]]:
            async def one(i: int) -> list[int]:
                p, t, s = cases[i]
                return [t for c in [c async for c in service.submit(p, max_new_tokens=20, temperature=t,
                                                                    seed=s).astream()] for t in c]
            return await asyncio.gather(*(one(i) for i in range(1, len(cases), 2)))

        for i, tokens in zip(range(1, len(cases), 2), asyncio.run(tasks()), strict=True):
            got[i] = tokens
        for thread in threads:
            thread.join(60)
    assert [got[i] for i in range(len(cases))] == expected


def test_greedy_under_the_dspark_scheduler_and_stop_strings(tmp_path):
    with tiny_runtime(tmp_path) as rt, EngineService(rt) as service:
        prompts = ["def parse_args(", "The quick brown", "import os\n", "for i in range("]
        full = [rt.generate(p, max_new_tokens=24)[0] for p in prompts]
        stops = [next((t[i : i + 2] for i in range(4, len(t) - 1) if "\ufffd" not in t[i : i + 2]), "zz")
                 for t in (rt.decode(r.tokens) for r in full)]
        expected = [rt.generate(p, max_new_tokens=24, stop=[s])[0] for p, s in zip(prompts, stops, strict=True)]
        handles = [service.submit(p, max_new_tokens=24) for p in prompts]
        handles += [service.submit(p, max_new_tokens=24, stop=[s]) for p, s in zip(prompts, stops, strict=True)]
        results = [h.result(60) for h in handles]
    assert [r.tokens for r in results] == [r.tokens for r in full] + [r.tokens for r in expected]
    assert [r.finish_reason for r in results[4:]] == [r.finish_reason for r in expected]


def test_cancel_frees_the_slot_for_the_next_request(tmp_path):
    with tiny_runtime(tmp_path, max_requests=1) as rt, EngineService(rt) as service:
        long = service.submit(PROMPTS[0], max_new_tokens=200)
        stream = long.stream(timeout=30)
        next(stream)
        waiting = service.submit(PROMPTS[1], max_new_tokens=5)
        wait_for(lambda: service.snapshot().queued == 1 and service.snapshot().running == 1)
        assert not waiting.done
        stream.close()  # the client stops reading: that cancels the request
        assert waiting.result(30).tokens == rt.generate(PROMPTS[1], max_new_tokens=5)[0].tokens
        assert long.result(0).finish_reason == "cancelled" and len(long.result(0).tokens) < 200
        wait_for(lambda: service.snapshot().kv_tokens_reserved == 0 and service.snapshot().running == 0)


def test_queue_limit_raises_queue_full(tmp_path):
    with tiny_runtime(tmp_path, max_requests=1) as rt, EngineService(rt, max_queue=2) as service:
        running = service.submit(PROMPTS[0], max_new_tokens=200)
        wait_for(running.tokens)  # running
        queued = [service.submit(p, max_new_tokens=3) for p in PROMPTS[1:3]]
        with pytest.raises(QueueFull, match="limit 2") as caught:
            service.submit(PROMPTS[3], max_new_tokens=3)
        assert caught.value.retry_after >= 1
        running.cancel()
        assert all(h.result(30).finish_reason == "length" for h in queued)
        assert service.submit(PROMPTS[3], max_new_tokens=3).result(30).tokens  # room again


def test_bad_requests_raise_in_submit_and_never_reach_the_loop(tmp_path):
    with tiny_runtime(tmp_path, max_seq_len=64) as rt, EngineService(rt, max_new_tokens=32) as service:
        for kwargs, error, match in [
            (dict(prompt=[1, 1000]), RequestError, "outside the vocabulary"),
            (dict(prompt=[]), RequestError, "empty"),
            (dict(prompt=[1], max_new_tokens=33), RequestError, "limit 32"),
            (dict(prompt=[1], temperature=float("nan")), RequestError, "temperature"),
            (dict(prompt=[1], seed=2**64), RequestError, "seed"),
            (dict(prompt=[1], seed=1.5), RequestError, "seed"),
            (dict(prompt=[1], stop=[10**6]), RequestError, "stop token ids"),
            (dict(prompt=[1] * 40, max_new_tokens=30), CapacityError, "slot holds 64"),
        ]:
            kwargs = {"max_new_tokens": 4, **kwargs}
            with pytest.raises(error, match=match):
                service.submit(kwargs.pop("prompt"), **kwargs)
        assert service.snapshot().submitted == 0
        assert service.submit([1, 2], max_new_tokens=4).result(30).tokens


class PoisonedBackend(TorchBackend):
    """Raises in any prefill holding POISON, and in one drafter call after `fail_draft` is set."""

    fail_draft = False

    def _run(self, graph, feeds):
        if graph.startswith("target") and feeds["input_ids"].shape[1] > 1 and (feeds["input_ids"] == POISON).any():
            raise RuntimeError("poisoned prefill")
        if graph == "drafter_backbone" and self.fail_draft:
            self.fail_draft = False
            raise RuntimeError("drafter fault")
        return super()._run(graph, feeds)


def test_a_failing_step_ends_only_the_requests_in_it(tmp_path, caplog):
    target_dir, drafter_dir = tiny_pair(tmp_path)
    target, drafter = load_pair(target_dir, drafter_dir)
    backend = PoisonedBackend(target, drafter)
    options = RuntimeOptions(scheduler=SchedulerConfig("dspark"), max_requests=2, max_seq_len=256)
    with Runtime(backend, ModelInfo.from_models(target, drafter), options, COST) as rt, EngineService(rt) as service:
        expected = rt.generate(PROMPTS[0], max_new_tokens=60)[0].tokens
        survivor = service.submit(PROMPTS[0], max_new_tokens=60)
        wait_for(survivor.tokens)  # running
        poisoned = service.submit([1, POISON, 2], max_new_tokens=5)  # fails in its own prefill
        with pytest.raises(RequestFailed, match="poisoned prefill"):
            poisoned.result(30)
        assert survivor.result(30).tokens == expected  # the running request went on, unharmed
        assert "poisoned prefill" in caplog.text

        a, b = (service.submit(p, max_new_tokens=100) for p in PROMPTS[1:3])
        queued = service.submit(PROMPTS[3], max_new_tokens=6)  # both slots are taken: it waits
        wait_for(lambda: a.tokens() and b.tokens())
        backend.fail_draft = True  # a fault after prefill: every running request was in that step
        for handle in (a, b):
            with pytest.raises(RequestFailed, match="drafter fault"):
                handle.result(30)
        assert queued.result(30).tokens == rt.generate(PROMPTS[3], max_new_tokens=6)[0].tokens
        assert service.alive and service.snapshot().failed == 3 and service.snapshot().kv_tokens_reserved == 0


def test_listeners_see_every_step_and_finish_and_cannot_stop_the_loop(tmp_path):
    with tiny_runtime(tmp_path) as rt, EngineService(rt) as service:
        steps, finished = [], []
        service.add_step_listener(lambda record, snapshot: steps.append((record.step, snapshot.running)))
        service.add_step_listener(lambda record, snapshot: 1 / 0)
        service.add_finish_listener(lambda result, timings: finished.append((result.request_id, timings)))
        service.add_finish_listener(lambda result, timings: [][1])
        handles = [service.submit(p, max_new_tokens=12) for p in PROMPTS]
        assert all(len(h.result(30).tokens) == 12 for h in handles)
        wait_for(lambda: len(finished) == len(PROMPTS))
        assert service.alive and max(running for _, running in steps) >= 2
        assert [step for step, _ in steps] == sorted({step for step, _ in steps})  # each step once, in order
        for _, timings in finished:
            assert timings.submitted <= timings.first_token <= timings.finished
            assert sum(timings.delivered) == 12 and len(timings.gaps) == len(timings.delivered) - 1


def test_close_ends_pending_requests_and_refuses_new_ones(tmp_path):
    with tiny_runtime(tmp_path, max_requests=1) as rt:
        service = EngineService(rt)
        running = service.submit(PROMPTS[0], max_new_tokens=200)
        queued = service.submit(PROMPTS[1], max_new_tokens=200)
        wait_for(running.tokens)  # running
        service.close()
        for handle in (running, queued):
            with pytest.raises(ServiceClosed):
                handle.result(5)
        with pytest.raises(ServiceClosed):
            service.submit(PROMPTS[2], max_new_tokens=2)
        assert not service.alive


def test_a_loop_that_died_ends_its_requests_and_refuses_new_ones(tmp_path, caplog):
    """A bug in the loop outside any step (here: handing results off raises) stops the loop: what was in
    flight ends with ServiceClosed naming the error, and submit refuses rather than queue for nobody."""
    with loop_breaking_runtime(tiny_opener(tmp_path, max_requests=1), tmp_path / "broke") as rt:
        service = EngineService(rt)
        running = service.submit(PROMPTS[0], max_new_tokens=200)
        with pytest.raises(ServiceClosed, match="a bug in the loop"):
            running.result(30)
        wait_for(lambda: not service.alive)
        with pytest.raises(ServiceClosed, match="engine loop stopped .*a bug in the loop"):
            service.submit(PROMPTS[1], max_new_tokens=2)
        assert "dspark engine loop stopped" in caplog.text
        service.close()


def test_the_load_snapshot_is_plain_json_while_requests_run(fixed_runtime):
    """/health serves asdict(snapshot()) as JSON: every field a plain number, also with KV in use."""
    with EngineService(fixed_runtime) as service:
        service.add_step_listener(lambda record, snapshot: time.sleep(0.02))  # a slow loop: still running below
        handle = service.submit([5, 6, 7], max_new_tokens=60)
        deadline = time.monotonic() + 30
        while service.snapshot().running == 0 and not handle.done and time.monotonic() < deadline:
            time.sleep(0.005)
        snapshot = asdict(service.snapshot())
        assert snapshot["running"] == 1 and snapshot["kv_tokens_used"] > 0
        json.dumps(snapshot)  # numpy integers would raise here
        assert all(type(v) in (int, float) for v in snapshot.values())
        handle.cancel()
