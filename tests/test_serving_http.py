"""The OpenAI `openai` client against a real uvicorn server on loopback: completions and chat, whole and
streamed, equal to `Runtime.generate` for the same seeds; chat's 400 without a template; the API key; a
client that disconnects frees its slot; 429 with Retry-After past the queue limit."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import openai
import pytest
from test_serving_support import running_server, tiny_runtime

from dspark.runtime.serving.app import ServerConfig, create_app
from dspark.runtime.serving.service import EngineService

MODEL = "tiny"
CASES = [("def parse_args(", 0.0, 0), ("The quick brown", 0.0, 1), ("import os\n", 0.9, 7), ("for i in", 1.4, 8)]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def parse_args("}]


@contextlib.contextmanager
def serving(root, *, api_key=None, max_queue=1024, **runtime_options):
    with tiny_runtime(root, **runtime_options) as rt, EngineService(rt, max_queue=max_queue) as service:
        app = create_app(service, ServerConfig(model_name=MODEL, api_key=api_key, max_tokens_per_request=200))
        with running_server(app) as url:
            yield rt, service, url


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("http")) as running:
        yield running


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def direct(rt, prompt, temperature, seed, max_tokens=16, stop=()):
    (result,) = rt.generate(prompt, max_new_tokens=max_tokens, temperature=temperature, seed=seed,
                            stop=[*stop, *rt.info.eos_token_ids])
    return result


@pytest.mark.parametrize(("prompt", "temperature", "seed"), CASES)
def test_completions_whole_and_streamed_equal_runtime_generate(server, prompt, temperature, seed):
    rt, _, url = server
    expected = direct(rt, prompt, temperature, seed)
    api = client(url)
    whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=temperature, seed=seed)
    assert whole.choices[0].text == expected.text
    assert whole.model_extra["dspark"]["token_ids"] == expected.tokens
    assert whole.model_extra["dspark"]["mean_accepted_length"] == pytest.approx(expected.mean_acceptance_length)
    assert whole.usage.prompt_tokens == len(rt.encode(prompt)) and whole.usage.completion_tokens == len(expected.tokens)
    assert whole.choices[0].finish_reason == "length"
    chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=temperature,
                                         seed=seed, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    ids = [t for c in chunks if c.choices for t in (c.model_extra.get("dspark") or {}).get("token_ids", [])]
    assert ids == expected.tokens
    assert chunks[-1].usage.completion_tokens == len(expected.tokens)
    assert chunks[-2].choices[0].finish_reason == "length"


def test_token_id_prompts_stop_strings_and_echo(server):
    rt, _, url = server
    api = client(url)
    ids = rt.encode("def parse_args(")
    whole = api.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, echo=True)
    expected = rt.decode(direct(rt, ids, 0.0, 0, 12).tokens)  # ids in: a plain RequestResult
    assert whole.choices[0].text == rt.decode(ids) + expected
    stop = next(expected[i : i + 2] for i in range(3, len(expected) - 1) if "\ufffd" not in expected[i : i + 2])
    cut = direct(rt, ids, 0.0, 0, 12, stop=[stop])
    whole = api.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, stop=[stop])
    assert whole.choices[0].text == cut.text and whole.choices[0].finish_reason == "stop"
    assert whole.model_extra["dspark"]["token_ids"] == cut.tokens and stop not in cut.text
    streamed = api.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_chat_whole_and_streamed_equal_runtime_chat(server):
    rt, _, url = server
    api = client(url)
    expected = rt.chat(MESSAGES, max_new_tokens=14, temperature=0.7, seed=3, stop=rt.info.eos_token_ids)
    whole = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=14, temperature=0.7, seed=3)
    assert whole.choices[0].message.content == expected.text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(expected.prompt_ids)
    streamed = list(api.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=14,
                                                temperature=0.7, seed=3, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected.text


def test_models_and_health(server):
    _, _, url = server
    assert [m.id for m in client(url).models.list()] == [MODEL]
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["slots_total"] == 64
    metrics = httpx.get(f"{url}/metrics")
    assert metrics.status_code == 200 and "dspark:num_requests_running" in metrics.text
    assert httpx.get(f"{url}/dashboard").status_code == 200
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client(url).completions.create(model="gpt-4", prompt="x", max_tokens=2)


def test_chat_without_template_is_a_clear_400(tmp_path):
    with serving(tmp_path, chat_template=None) as (_, _, url):
        with pytest.raises(openai.BadRequestError, match="no chat template") as caught:
            client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert caught.value.body["param"] == "messages"
        assert client(url).completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None


def test_api_key_guards_v1(tmp_path):
    with serving(tmp_path, api_key="sesame") as (_, _, url):
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}).status_code == 401
        assert client(url, "sesame").completions.create(model=MODEL, prompt="x", max_tokens=2).usage
        assert httpx.get(f"{url}/health").status_code == 200


def _raw_request(url: str, body: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def _wait(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def first_event(response: httpx.Response) -> str:
    """The first SSE data line of a streamed response."""
    return next(line for line in response.iter_lines() if line.startswith("data: "))


class Throttle:
    """A step listener holding the loop thread: `delay` seconds after every step, and while `gate` is
    clear, no further step at all; so a long request stays running for as long as a test needs."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay, self.gate = delay, threading.Event()
        self.gate.set()

    def __call__(self, record, snapshot) -> None:
        time.sleep(self.delay)
        self.gate.wait(30)


def test_disconnected_clients_free_their_slot(tmp_path):
    with serving(tmp_path, max_requests=1) as (rt, service, url):
        service.add_step_listener(Throttle(delay=0.05))  # 200 tokens take seconds: the client leaves first
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "def", "max_tokens": 200, "stream": True,
                                                                 "temperature": 0}) as response:
            first_event(response)  # running: its first chunk arrived; then the client hangs up
        _wait(lambda: service.snapshot().cancelled == 1 and service.snapshot().running == 0)
        sock = _raw_request(url, b'{"prompt": "def", "max_tokens": 200, "temperature": 0}')  # whole, not streamed
        _wait(lambda: service.snapshot().running == 1)
        sock.close()
        _wait(lambda: service.snapshot().cancelled == 2 and service.snapshot().kv_tokens_reserved == 0)
        answer = client(url).completions.create(model=MODEL, prompt="import", max_tokens=8, temperature=0)
        assert answer.model_extra["dspark"]["token_ids"] == direct(rt, "import", 0.0, 0, 8).tokens


def test_queue_limit_gives_429_with_retry_after(tmp_path):
    with serving(tmp_path, max_requests=1, max_queue=1) as (_, service, url):
        throttle = Throttle()
        service.add_step_listener(throttle)
        throttle.gate.clear()  # the loop stops after the next step: what arrives now waits
        with httpx.stream("POST", f"{url}/v1/completions",
                          json={"prompt": "def", "max_tokens": 200, "stream": True}) as running:
            first_event(running)
            waiting = _raw_request(url, b'{"prompt": "x", "max_tokens": 2}')
            _wait(lambda: service.snapshot().submitted == 2)
            refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                client(url).completions.create(model=MODEL, prompt="x", max_tokens=2)
            throttle.gate.set()
        waiting.settimeout(30)
        assert waiting.recv(12) == b"HTTP/1.1 200"
        waiting.close()


@pytest.mark.parametrize("chat", [False, True])
def test_pre_rendered_token_chunks_equal_the_chunk_objects(chat):
    from dspark.runtime.serving import protocol as P

    request = P.ServeRequest(chat=chat, model=None)
    chunks = P.TokenChunks(request, "cmpl-x", 'a "model"', 17)
    for text in ("", 'héllo "q"\n\u2028\\', "x"):
        expected = P.sse(P.chunk(request, "cmpl-x", 'a "model"', 17, text=text, extras={"token_ids": [1, 22, 333]}))
        assert chunks.render(text, [1, 22, 333]) == expected
