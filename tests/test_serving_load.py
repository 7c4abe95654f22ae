"""A bounded load test on loopback: 1000 concurrent streaming clients (httpx AsyncClient, one connection
each) against a real uvicorn server; none lost or truncated, and every streamed text and token list equal to
the direct API's (`Runtime.generate`, same seeds). Half the clients sample: the `fixed` scheduler keeps each
request's sampling stream its own whatever else is in the batch, so outputs compare token for token."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from test_serving_support import engine_service, running_server, tiny_opener

from dspark.runtime.serving.app import ServerConfig, create_app

CLIENTS, MAX_TOKENS, SEED = 1000, 8, 1000
WORDS = ["def", "parse", "args", "class", "Server", "import", "os", "sys", "for", "while", "return", "print"]


def prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i % 5)) + f" {i % 37}"


async def stream_one(http: httpx.AsyncClient, i: int) -> dict:
    body = {"model": "tiny", "prompt": prompt(i), "max_tokens": MAX_TOKENS, "stream": True,
            "temperature": 0.0 if i % 2 == 0 else 0.8, "seed": SEED + i // 2}
    text, ids, finish, done = [], [], None, False
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            choice = event["choices"][0] if event["choices"] else {}
            text.append(choice.get("text", ""))
            ids += (event.get("dspark") or {}).get("token_ids", [])
            finish = choice.get("finish_reason") or finish
    return {"text": "".join(text), "ids": ids, "finish": finish, "done": done}


async def swarm(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as http:
        return await asyncio.gather(*(stream_one(http, i) for i in range(CLIENTS)))


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_1000_concurrent_streams_all_complete_and_equal_the_direct_api(tmp_path, kind):
    """kind: the engine loop in the server's process (a thread) or in an engine process of its own."""
    open_runtime = tiny_opener(tmp_path, scheduler="fixed", max_requests=256, max_seq_len=64)
    with open_runtime() as rt:
        eos = rt.info.eos_token_ids
        greedy = rt.generate([prompt(i) for i in range(0, CLIENTS, 2)], max_new_tokens=MAX_TOKENS, stop=eos)
        sampled = rt.generate([prompt(i) for i in range(1, CLIENTS, 2)], max_new_tokens=MAX_TOKENS, temperature=0.8,
                              seed=SEED, stop=eos)  # prompt j of this batch gets seed SEED + j, as client 2j+1
        expected = [r for pair in zip(greedy, sampled, strict=True) for r in pair]
        with engine_service(kind, rt, open_runtime, max_queue=CLIENTS) as service:
            app = create_app(service, ServerConfig(model_name="tiny", max_tokens_per_request=MAX_TOKENS))
            with running_server(app) as url:
                begin = time.monotonic()
                results = asyncio.run(swarm(url))
                seconds = time.monotonic() - begin
            snapshot = service.snapshot()
    assert len(results) == CLIENTS and all(r["done"] for r in results), "a stream was lost or cut short"
    assert all(r["finish"] == "length" for r in results)
    mismatched = [i for i, (r, e) in enumerate(zip(results, expected, strict=True))
                  if r["ids"] != e.tokens or r["text"] != e.text]
    assert not mismatched, f"{len(mismatched)} outputs differ from the direct API, e.g. client {mismatched[:5]}"
    assert snapshot.finished == CLIENTS and snapshot.failed == 0 and snapshot.cancelled == 0
    assert seconds < 180, f"{CLIENTS} streams took {seconds:.1f} s"  # a hang guard: about 15 s on an idle 2-core CPU
