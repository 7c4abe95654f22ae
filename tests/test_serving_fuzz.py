"""A fuzz of malformed requests against a real server (with an API key): bad JSON, wrong types, unknown
fields, unsupported values, negative/NaN/huge numbers, oversized bodies and prompts, wrong paths and
methods, bad auth. Every one gets a 4xx with an OpenAI-style error object; none fails the engine loop; and
afterwards the server still answers exactly as `Runtime.generate`."""

from __future__ import annotations

import json
import random
import socket

import httpx
import pytest
from test_serving_support import engine_service, running_server, tiny_opener

from dspark.runtime.serving.app import ServerConfig, create_app
from dspark.runtime.serving.protocol import ApiError, parse_json

KEY = "fuzz-key"
GOOD = {"model": "tiny", "prompt": "def parse_args(", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_VALUES = {
    "prompt": [None, 5, 1.5, True, {}, [], [[]], [1.5], [-1], [10**6], [True], ["a", "b"], [[1], [2]], "", [{"a": 1}]],
    "max_tokens": ["8", 1.5, -1, 0, True, 10**30, [], {}, 201],
    "temperature": ["hot", -0.1, 2.5, True, [], {}, 3],
    "seed": ["1", 1.5, True, 2**64, -(2**63) - 1, [], {}],
    "stop": [5.5, [""], [None], [1.5], {"a": 1}, ["x"] * 17, ["y" * 300], True, [-3], [10**6]],
    "stream": ["yes", 1, [], {}],
    "echo": ["no", 0, []],
    "n": [2, 0, "1", 5],
    "model": [5, [], {}, "gpt-4", ""],
    "stream_options": [{"include_usage": True}, {"x": 1}, "a"],
    "user": [5, [], {}],
    "top_p": [0.5, 0, "1"], "logprobs": [3, True], "best_of": [2], "frequency_penalty": [0.5],
    "presence_penalty": [-1], "logit_bias": [{"5": 100}], "suffix": ["tail"],
}
CHAT_BAD = {
    "messages": [None, [], "hi", [1], [{"role": "user"}], [{"content": "x"}], [{"role": 5, "content": "x"}],
                 [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
                 [{"role": "user", "content": "x", "tool_calls": []}], [{"role": "user", "content": "x", "name": 3}]],
    "max_completion_tokens": [-1, "4", 10**9], "tools": [[{"type": "function"}]], "tool_choice": ["auto"],
    "response_format": [{"type": "json_object"}], "top_logprobs": [3],
}


def cases(rng: random.Random, big: int) -> list[tuple[str, str, dict, bytes]]:
    """(method, path, headers, body) of malformed requests."""
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    out: list[tuple[str, str, dict, bytes]] = []

    def post(body: object, path: str = "/v1/completions", headers: dict | None = None) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        out.append(("POST", path, headers or auth, raw))

    good = json.dumps(GOOD).encode()
    for cut in range(1, len(good), 3):  # truncated JSON
        post(good[:cut])
    for _ in range(12):  # random bytes, often not UTF-8
        post(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
    for body in (b"", b"null", b"[]", b'"text"', b"42", b"true", b"{'single': 1}", b"{,}", b'{"a":1,}',
                 b'{"prompt": NaN}', b'{"max_tokens": Infinity}', b'{"temperature": -Infinity}',
                 b'{"max_tokens": 1' + b"0" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000,
                 b'{"a":' * 200 + b"1" + b"}" * 200, b"\xff\xfe{}", b'{"prompt": "\xff"}'):
        post(body)
    for name, values in BAD_VALUES.items():
        for value in values:
            post({**GOOD, name: value})
    for name, values in CHAT_BAD.items():
        for value in values:
            post({**CHAT, name: value}, "/v1/chat/completions")
    for _ in range(20):  # unknown fields
        name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randrange(1, 12)))
        post({**GOOD, f"x_{name}": rng.choice([1, "a", None, [1]])})
    post({**GOOD, "messages": CHAT["messages"]})  # a chat field on completions
    post({**CHAT, "prompt": "x"}, "/v1/chat/completions")
    post({**GOOD, "prompt": list(range(1, 251)), "max_tokens": 100})  # prompt + max_tokens beyond a slot
    post({**GOOD, "prompt": "word " * 3000})  # a prompt longer than any slot
    post({**GOOD, "prompt": "x" * (big + 10)})  # body over the cap: 413
    for length in (str(50 * big), "-5", "abc", "12, 13"):  # lying or broken Content-Length (sent raw)
        out.append(("RAW", "/v1/completions", {**auth, "Content-Length": length}, b"{}"))
    for method, path in [("GET", "/v1/completions"), ("PUT", "/v1/completions"), ("DELETE", "/v1/chat/completions"),
                         ("GET", "/v1/chat/completions"), ("POST", "/v1/models"), ("POST", "/health"),
                         ("GET", "/v2/completions"), ("GET", "/v1/completions/x"), ("GET", "/"), ("GET", "/v1"),
                         ("PATCH", "/v1/models"), ("GET", "/v1/models/other"), ("GET", "/%2e%2e/etc/passwd")]:
        out.append((method, path, auth, good if method == "POST" else b""))
    for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"},
                    {"Authorization": f"Bearer {KEY}x"}, {"Authorization": "Bearer fuzz-kéy".encode()},
                    {"Authorization": f"bearer  {KEY[:-1]}"}):
        post(GOOD, headers={"Content-Type": "application/json", **headers})
        post(CHAT, "/v1/chat/completions", headers={"Content-Type": "application/json", **headers})
    return out


def raw_status(url: str, path: str, headers: dict, body: bytes) -> int:
    """The status line's code for a request sent byte for byte (clients refuse to send a wrong length)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body)
        return int(sock.recv(64).split(b" ")[1])


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_malformed_requests_all_get_4xx_and_the_server_still_serves(tmp_path, kind):
    """kind: the engine loop in the server's process (a thread) or in an engine process of its own."""
    big = 64 * 1024
    open_runtime = tiny_opener(tmp_path, max_seq_len=256)
    with open_runtime() as rt, engine_service(kind, rt, open_runtime) as service:
        config = ServerConfig(model_name="tiny", api_key=KEY, max_body_bytes=big, max_tokens_per_request=200)
        with running_server(create_app(service, config)) as url, httpx.Client(base_url=url, timeout=30) as http:
            fuzz = cases(random.Random(15), big)
            assert len(fuzz) >= 200
            statuses = {}
            for method, path, headers, body in fuzz:
                if method == "RAW":
                    status = raw_status(url, path, headers, body)
                    statuses[status] = statuses.get(status, 0) + 1
                    assert 400 <= status < 500, headers
                    continue
                response = http.request(method, path, headers=headers, content=body)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                assert 400 <= response.status_code < 500, (method, path, body[:80], response.text[:200])
                error = response.json()["error"]
                assert isinstance(error["message"], str) and error["message"] and "Traceback" not in response.text
            assert {400, 401, 404, 405, 413} <= set(statuses)
            assert service.alive and service.snapshot().failed == 0
            answer = http.post("/v1/completions", json=GOOD, headers={"Authorization": f"Bearer {KEY}"}).json()
            (expected,) = rt.generate(GOOD["prompt"], max_new_tokens=4, temperature=0, stop=rt.info.eos_token_ids)
            assert answer["choices"][0]["text"] == expected.text
            assert answer["dspark"]["token_ids"] == expected.tokens


@pytest.mark.parametrize("raw", [b'{"a": NaN}', b'{"a": [Infinity]}', b'{"a": -Infinity}', b"[" * 70 + b"]" * 70,
                                 b"[" * 100_000 + b"]" * 100_000, b"[]", b"7", b'"x"', b"\xff"])
def test_the_parser_itself_refuses_what_json_does_not_allow(raw):
    """Defence in depth: these are refused before any field check could."""
    with pytest.raises(ApiError) as caught:
        parse_json(raw)
    assert caught.value.status == 400
