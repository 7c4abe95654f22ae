"""The engine service with its loop in a process of its own (`ProcessService`): concurrent clients get exactly
`Runtime.generate`'s outputs, bad requests raise in the caller's thread, the queue limit holds, cancel frees the
slot, the metrics hear every step and end, the OpenAI app serves it unchanged, and a dead engine process fails
its requests and the service (never hangs them)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading

import openai
import pytest
from test_serving_service import collect, wait_for
from test_serving_support import loop_breaking_runtime, running_server, tiny_opener

from dspark.runtime.api import Runtime
from dspark.runtime.capacity import CapacityError
from dspark.runtime.requests import RequestError
from dspark.runtime.serving.app import ServerConfig, create_app
from dspark.runtime.serving.metrics import ServingMetrics
from dspark.runtime.serving.process_service import EngineProcessFailed, ProcessService
from dspark.runtime.serving.service import QueueFull, RequestFailed, ServiceClosed

PROMPTS = [[67, 24, 319, 84, 473], [5, 6, 7], [100, 200, 300, 400, 8, 9, 10], [42], [7, 7, 7, 7]]


def opener(root, *, max_requests: int = 8):
    """`fixed` γ, no live cost: sampled tokens do not depend on the batch or on timing, so they compare token for
    token with `Runtime.generate`."""
    return tiny_opener(root, scheduler="fixed", max_requests=max_requests)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(opener, a Runtime of the same pair in this process: the reference outputs)."""
    open_runtime = opener(tmp_path_factory.mktemp("process"))
    with open_runtime() as rt:
        yield open_runtime, rt


@pytest.fixture(scope="module")
def service(pair):
    with ProcessService(pair[0], max_new_tokens=200) as running:
        yield running


def test_threads_and_tasks_get_runtime_generate_outputs(pair, service):
    _, rt = pair
    cases = [(p, t, seed) for p in PROMPTS for t, seed in ((0.0, 0), (0.9, 11), (1.3, 12))]
    expected = [rt.generate(p, max_new_tokens=20, temperature=t, seed=s)[0] for p, t, s in cases]
    got: dict[int, list[int]] = {}

    def client(i: int) -> None:
        p, t, s = cases[i]
        got[i] = collect(service.submit(p, max_new_tokens=20, temperature=t, seed=s))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(0, len(cases), 2)]
    for thread in threads:
        thread.start()

    async def tasks() -> None:
        async def one(i: int) -> None:
            p, t, s = cases[i]
            handle = service.submit(p, max_new_tokens=20, temperature=t, seed=s)
            got[i] = [t for chunk in [c async for c in handle.astream()] for t in chunk]
            result = handle.result(0)
            assert result.tokens == expected[i].tokens and result.finish_reason == expected[i].finish_reason
            assert result.acceptance_lengths == expected[i].acceptance_lengths

        await asyncio.gather(*(one(i) for i in range(1, len(cases), 2)))

    asyncio.run(tasks())
    for thread in threads:
        thread.join(60)
    assert [got[i] for i in range(len(cases))] == [e.tokens for e in expected]


def test_stop_strings_and_text_prompts_end_where_runtime_generate_does(pair, service):
    _, rt = pair
    stop = ["\n", *rt.info.eos_token_ids]
    (expected,) = rt.generate("def parse_args(", max_new_tokens=40, temperature=0.0, stop=stop)
    handle = service.submit("def parse_args(", max_new_tokens=40, stop=stop)
    assert collect(handle) == expected.tokens and handle.result(0).finish_reason == expected.finish_reason


def test_bad_requests_raise_in_the_callers_thread(service):
    before = service.snapshot().submitted
    with pytest.raises(RequestError, match="token id"):
        service.submit([5, 10**6], max_new_tokens=4)
    with pytest.raises(RequestError, match="seed"):
        service.submit([5], max_new_tokens=4, seed="x")
    with pytest.raises(RequestError, match="limit 200"):
        service.submit([5], max_new_tokens=201)
    with pytest.raises(CapacityError):
        service.submit([5] * 200, max_new_tokens=100)
    assert service.room(10) == min(256 - 10 - service.limits.reserve_extra, 200)
    assert service.snapshot().submitted == before and service.alive


def test_cancel_frees_the_slot(service):
    handle = service.submit([5, 6, 7], max_new_tokens=200)
    wait_for(lambda: len(handle.tokens()) > 0)
    handle.cancel()
    result = handle.result(30)
    assert result.finish_reason == "cancelled" and len(result.tokens) < 200
    wait_for(lambda: service.snapshot().running == 0)


def test_metrics_hear_every_step_and_end(pair):
    with ProcessService(pair[0]) as service:
        metrics = ServingMetrics(service)
        handles = [service.submit(p, max_new_tokens=12) for p in PROMPTS]
        results = [h.result(60) for h in handles]
        wait_for(lambda: metrics.quality_state()["totals"]["finished"] == len(PROMPTS))
        # the last turn's step listeners run after its ends were handed out: wait for them too
        wait_for(lambda: metrics.quality_state()["totals"]["steps"] == service.snapshot().steps)
        totals = metrics.quality_state()["totals"]
        assert totals["generation_tokens"] == sum(len(r.tokens) for r in results)
        assert totals["steps"] == service.snapshot().steps > 0
        assert totals["committed"] >= totals["generation_tokens"]
        assert b"dspark:time_to_first_token_seconds_count" in metrics.render()[0]


def test_queue_limit_holds(pair):
    with ProcessService(opener(pair[0].args[0].parent / "one", max_requests=1), max_queue=2) as service:
        running = service.submit([5, 6, 7], max_new_tokens=200)
        wait_for(lambda: service.snapshot().running == 1)
        waiting = [service.submit([5, 6, 7], max_new_tokens=200) for _ in range(2)]
        with pytest.raises(QueueFull):
            service.submit([5], max_new_tokens=4)
        for handle in [running, *waiting]:
            handle.cancel()
        for handle in [running, *waiting]:
            assert handle.result(30).finish_reason == "cancelled"
        assert service.submit([5], max_new_tokens=4).result(30).finish_reason in ("length", "stop")


def test_openai_client_through_the_app(pair, service):
    _, rt = pair
    (expected,) = rt.generate("The quick brown", max_new_tokens=16, temperature=0.9, seed=5,
                              stop=rt.info.eos_token_ids)
    app = create_app(service, ServerConfig(model_name="tiny", max_tokens_per_request=200))
    with running_server(app) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        whole = api.completions.create(model="tiny", prompt="The quick brown", max_tokens=16, temperature=0.9, seed=5)
        chunks = list(api.completions.create(model="tiny", prompt="The quick brown", max_tokens=16, temperature=0.9,
                                             seed=5, stream=True))
    assert whole.model_extra["dspark"]["token_ids"] == expected.tokens
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks) == expected.text


def test_a_dead_engine_process_without_restarts_fails_its_requests_and_the_service(pair):
    service = ProcessService(pair[0], max_restarts=0)
    try:
        handle = service.submit([5, 6, 7], max_new_tokens=200)
        wait_for(lambda: len(handle.tokens()) > 0)
        os.kill(service.engine_pid, signal.SIGKILL)
        with pytest.raises(RequestFailed, match="engine process exited"):
            handle.result(30)
        wait_for(lambda: not service.alive)
        with pytest.raises(ServiceClosed, match="engine process exited"):
            service.submit([5], max_new_tokens=4)
    finally:
        service.close()


def test_an_engine_process_whose_loop_died_gives_way_to_a_fresh_one(tmp_path):
    """A bug in the engine loop outside any step stops that loop; its process exits (it would otherwise take
    requests nobody steps), and the front end restarts it: the request that had tokens fails, the next is served."""
    breaking = functools.partial(loop_breaking_runtime, opener(tmp_path, max_requests=1), tmp_path / "broke")
    with ProcessService(breaking, max_restarts=1) as service:
        first_pid = service.engine_pid
        with pytest.raises(RequestFailed, match="exited"):
            service.submit([5, 6, 7], max_new_tokens=60).result(60)
        assert (tmp_path / "broke").exists()
        wait_for(lambda: service.alive and service.engine_pid != first_pid, 120)
        assert service.submit([42], max_new_tokens=8).result(60).finish_reason in ("length", "stop")


def test_an_engine_that_cannot_open_says_why(tmp_path):
    with pytest.raises(EngineProcessFailed, match="no-such-engine"):
        ProcessService(functools.partial(Runtime.load, str(tmp_path / "no-such-engine")), start_timeout=120)


def test_metrics_resources_count_the_engine_process(pair, service):
    import psutil

    metrics = ServingMetrics(service)
    engine_rss = psutil.Process(service.engine_pid).memory_info().rss
    assert metrics.resources()["rss_bytes"] >= psutil.Process().memory_info().rss + 0.9 * engine_rss


def test_the_front_end_keeps_nothing_per_finished_request(tmp_path):
    """4,000 mixed requests (greedy and sampled, blocking and asyncio readers, stop strings, cancels) after a
    warm-up wave: the front end's ledger is empty and its RSS flat (the soak of test_serving_soak, shorter)."""
    import psutil
    from test_serving_soak import WAVE, live_rss, wave

    front = psutil.Process()
    with ProcessService(opener(tmp_path, max_requests=64), max_queue=WAVE) as service:
        done = 0
        while done < 2 * WAVE:
            assert wave(service, done, WAVE) > 0
            done += WAVE
        warm_rss = live_rss(front)
        while done < 6 * WAVE:
            wave(service, done, WAVE)
            done += WAVE
        end_rss = live_rss(front)
        wait_for(lambda: service.snapshot().finished == done)
        snapshot = service.snapshot()
        assert snapshot.failed == 0 and snapshot.cancelled > 0 and snapshot.running == snapshot.queued == 0
        assert not service._handles  # every end arrived and was dropped
    assert (end_rss - warm_rss) / 2**20 < 4, f"front end RSS grew {(end_rss - warm_rss) / 2**20:.1f} MiB"


def test_a_fresh_engine_takes_the_requests_that_had_no_token(tmp_path):
    """One slot: the running request has tokens when its engine is killed and fails; the queued ones had none,
    so a fresh engine process runs them and they end exactly as `Runtime.generate` says; a cancel while the
    engine restarts ends that request here; then the service serves again, and the metrics follow the new pid."""
    open_runtime = opener(tmp_path, max_requests=1)
    prompts = [[5, 6, 7], [42], [100, 200, 300, 400, 8]]
    with open_runtime() as rt:
        expected = [rt.generate(p, max_new_tokens=12, temperature=0.9, seed=3)[0].tokens for p in prompts[1:]]
    with ProcessService(open_runtime, max_restarts=1) as service:
        metrics = ServingMetrics(service)
        first_pid = service.engine_pid
        running = service.submit(prompts[0], max_new_tokens=200)
        wait_for(lambda: len(running.tokens()) > 0)
        queued = [service.submit(p, max_new_tokens=12, temperature=0.9, seed=3) for p in prompts[1:]]
        doomed = service.submit([7, 7], max_new_tokens=12)
        steps_before = service.snapshot().steps
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(RequestFailed, match="while generating"):
            running.result(30)
        wait_for(lambda: service._restarting or service.alive)
        if service._restarting:
            doomed.cancel()
        assert [h.result(120).tokens for h in queued] == expected
        assert doomed.result(60).finish_reason in ("cancelled", "length", "stop")
        wait_for(lambda: service.alive, 120)
        assert service.restarts == 1 and service.engine_pid != first_pid
        assert service.submit([5], max_new_tokens=4).result(60).finish_reason in ("length", "stop")
        wait_for(lambda: service.snapshot().finished == 5)
        totals = service.snapshot()  # over both engines: the health page's counters do not restart with one
        assert (totals.submitted, totals.failed) == (5, 1) and steps_before >= 1
        assert totals.steps >= steps_before + service._snapshot.steps  # the fresh engine's own count, and the first's
        assert metrics._processes()[-1].pid == service.engine_pid
        os.kill(service.engine_pid, signal.SIGKILL)  # out of restarts: the service is down for good
        wait_for(lambda: not service.alive and not service._restarting and not service._reader.is_alive())
        with pytest.raises(ServiceClosed, match="exited"):
            service.submit([5], max_new_tokens=4)
