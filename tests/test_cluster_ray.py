"""Two dspark engine replicas on a real local Ray cluster (started once for the module, 2 CPUs, stopped at the
end) behind the ingress's OpenAI endpoint: outputs equal `Runtime.generate` token for token (greedy and seeded
sampling, whole and streamed), /metrics carries every replica's samples with a replica label, a full fleet
answers 429, and a SIGKILLed replica worker leaves the endpoint up: its streams in progress move to the
survivor from the snapshot keeper (a detached actor) and complete there identical to `Runtime.generate`, no
token twice and none missing; new requests go to the survivor, and Ray Serve brings the replica back.

The `fixed` scheduler: each request's drafts (so a seeded sampled request's tokens) are its own whatever
shares its batch, so a stream moved into another replica's batch is comparable token for token (with `dspark`
the batch shares a draft budget; test_cluster_keeper.py moves a sampled `dspark` stream that runs alone).

Cost: Ray and Serve start in ~10-20 s on the shared 2-core machine; the module runs in about a minute."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from conftest import golden_path
from test_serving_support import COST, free_socket, tiny_pair

from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.serving.app import ServerConfig

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'dspark[ray]')")
serve = pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install 'dspark[ray]')")

OPTIONS = RuntimeOptions(scheduler=SchedulerConfig("fixed"), max_requests=4, max_seq_len=256, live_cost=False)
MAX_QUEUE = 4
MODEL = "tiny"
CASES = [("def parse_args(", 0.0, 0), ("The quick brown", 0.0, 1), ("import os\n", 0.9, 7), ("for i in", 1.4, 8)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from dspark.runtime.cluster.deploy import build_app
    from dspark.runtime.cluster.replica import EngineSpec

    target, drafter = tiny_pair(tmp_path_factory.mktemp("ray"))
    spec = EngineSpec(target_dir=str(target), drafter_dir=str(drafter), options=OPTIONS, cost_model=COST)
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20,
             configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(spec, replicas=2, policy="round_robin", max_queue=MAX_QUEUE, cpus_per_replica=0.5,
                        config=ServerConfig(model_name=MODEL, max_tokens_per_request=200))
        serve.run(app, name="dspark-test", route_prefix="/")
        with Runtime.from_checkpoints(target, golden_path("qwen3-tiny-vanilla", "drafter"), OPTIONS,
                                      cost_model=COST) as rt:
            yield f"http://127.0.0.1:{port}", rt
    finally:
        serve.shutdown()
        ray.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def expected(rt, prompt, temperature, seed, max_tokens):
    (result,) = rt.generate(prompt, max_new_tokens=max_tokens, temperature=temperature, seed=seed,
                            stop=list(rt.info.eos_token_ids))
    return result


def replicas(url: str) -> dict[str, dict]:
    return {r["name"]: r for r in httpx.get(f"{url}/replicas", timeout=30).json()["replicas"]}


@pytest.mark.parametrize(("prompt", "temperature", "seed"), CASES)
def test_outputs_through_two_replicas_equal_runtime_generate(cluster, prompt, temperature, seed):
    url, rt = cluster
    want = expected(rt, prompt, temperature, seed, 16)
    api = client(url)
    before = {name: r["routed"] for name, r in replicas(url).items()}
    whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=temperature, seed=seed)
    assert whole.model_extra["dspark"]["token_ids"] == want.tokens and whole.choices[0].text == want.text
    assert whole.model_extra["dspark"]["acceptance_lengths"] == want.acceptance_lengths
    assert whole.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=temperature,
                                         seed=seed, stream=True))
    assert [t for c in chunks for t in (c.model_extra.get("dspark") or {}).get("token_ids", [])] == want.tokens
    assert "".join(c.choices[0].text for c in chunks) == want.text
    after = {name: r["routed"] for name, r in replicas(url).items()}
    assert all(after[name] == before[name] + 1 for name in after)  # round-robin: one request on each replica


def test_metrics_carry_each_replicas_samples_and_health_sums_them(cluster):
    url, _ = cluster
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for name in ("dspark-engine-0", "dspark-engine-1"):
        assert f'dspark:num_requests_running{{replica="{name}"}}' in text
        assert f'dspark:replica_up{{replica="{name}"}} 1.0' in text
        line = next(x for x in text.splitlines() if x.startswith(f'dspark:generation_tokens_total{{replica="{name}"}}'))
        assert float(line.split()[-1]) > 0
    health = httpx.get(f"{url}/health", timeout=30).json()
    assert health["status"] == "ok" and health["slots_total"] == 2 * OPTIONS.max_requests
    assert health["max_queue"] == 2 * MAX_QUEUE


def test_a_full_fleet_answers_429_and_serves_the_rest(cluster):
    url, _ = cluster
    held = 2 * (OPTIONS.max_requests + MAX_QUEUE)
    statuses: list[int] = []
    bodies: list[str] = []

    def one() -> None:
        body = {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 200, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        statuses.append(response.status_code)
        bodies.append(response.text[:300])

    threads = [threading.Thread(target=one) for _ in range(held + 6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert not any(t.is_alive() for t in threads)  # no request hangs
    assert statuses.count(429) >= 1 and set(statuses) == {200, 429}, bodies
    assert statuses.count(200) >= held


def _stream(url: str, case: tuple, events: list, started: threading.Event) -> None:
    prompt, temperature, seed = case
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": temperature, "seed": seed,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append((time.monotonic(), json.loads(line[6:])))
                started.set()


def test_a_killed_replicas_streams_complete_on_the_survivor_identically(cluster):
    url, rt = cluster
    victim = replicas(url)["dspark-engine-1"]
    before = httpx.get(f"{url}/replicas", timeout=30).json()["migrated"]
    # round-robin: a greedy and a seeded sampled stream on each replica
    cases = [([11, 12, 13], 0.0, 0), ([14, 12, 13], 0.0, 0), ([15, 12], 0.9, 7), ([16, 12], 1.3, 8)]
    streams = [([], threading.Event()) for _ in cases]
    threads = [threading.Thread(target=_stream, args=(url, case, *stream))
               for case, stream in zip(cases, streams, strict=True)]
    for thread, (_, started) in zip(threads, streams, strict=True):
        thread.start()  # one after another: round-robin alternates the replicas
        assert started.wait(60)
    killed = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    state = httpx.get(f"{url}/replicas", timeout=30).json()
    for case, (events, _) in zip(cases, streams, strict=True):
        assert "error" not in events[-1][1], events[-1][1]
        tokens = [t for _, e in events for t in (e.get("dspark") or {}).get("token_ids", [])]
        assert tokens == expected(rt, *case, 200).tokens  # none twice, none missing, none different
        assert events[-1][1]["choices"][0]["finish_reason"] in ("length", "stop")
    # the victim's two streams moved, less any that had ended before the kill: its first stream runs while the
    # others start one after another, and on a loaded machine (CI beside another suite) it can finish first
    resumed = [min((t - killed for t, _ in events if t > killed), default=None) for events, _ in streams]
    ended = resumed.count(None)
    assert 2 - ended <= state["migrated"] - before <= 2 and state["diverged"] == 0, (state, ended)
    print("first event after the kill, per stream: "
          + ", ".join("ended before it" if s is None else f"{1000 * s:.0f} ms" for s in resumed))

    deadline = time.monotonic() + 30
    while replicas(url)["dspark-engine-1"]["up"] and time.monotonic() < deadline:
        time.sleep(0.05)
    state = replicas(url)
    routed = state["dspark-engine-1"]["routed"]
    for i in range(3):  # while it is down (or already back): every request is served
        body = {"model": MODEL, "prompt": [31 + i, 5], "max_tokens": 8, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200
        assert response.json()["dspark"]["token_ids"] == expected(rt, [31 + i, 5], 0.0, 0, 8).tokens
    after = replicas(url)
    if not state["dspark-engine-1"]["up"] and not after["dspark-engine-1"]["up"]:
        assert after["dspark-engine-1"]["routed"] == routed  # down the whole time: none went to it

    deadline = time.monotonic() + 90  # Ray Serve restarts the replica; the router takes it back
    while not (after := replicas(url))["dspark-engine-1"]["up"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert after["dspark-engine-1"]["up"] and after["dspark-engine-1"]["pid"] != victim["pid"]


def test_serve_run_target_names_what_is_wrong_with_its_arguments():
    from dspark.runtime.cluster.deploy import app_builder

    with pytest.raises(ValueError, match="engine=DIR is required"):
        app_builder({"replicas": "2"})
    with pytest.raises(ValueError, match="unknown argument.*replica_count"):
        app_builder({"engine": "/x", "replica_count": "2"})
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        app_builder({"engine": "/x", "routing": "random"})
