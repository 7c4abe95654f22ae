"""`--journal` end to end: a real server subprocess, SIGKILLed mid-stream, restarted on the same journal;
clients reconnect with Last-Event-ID and get the rest of their streams. Greedy and seeded sampling alike,
the whole output equals an uninterrupted run's, no token twice and none missing."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from test_journal_support import events, kill, start_server, token_ids, wait_healthy
from test_serving_support import free_socket, tiny_runtime

CASES = [("def parse_args(", 0.0, 0), ("import os\n", 0.9, 7)]  # greedy, and sampled by seed
MAX_TOKENS = 160


def _free_port() -> int:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    return port


def _body(prompt: str, temperature: float, seed: int) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": seed,
            "stream": True}


def _read(stream, tokens: list[int], ids: list[str], limit: int | None = None) -> bool:
    """Events of `stream` (an `events` iterator) into `tokens` (checking each id is RID/N with N the tokens so
    far); True once [DONE] came. The iterator stays open: a dropped one closes its connection, and the server
    then cancels the request (a client that went away), which is not what this test is about."""
    for event_id, data in stream:
        if data == "[DONE]":
            return True
        tokens += token_ids(data)
        if event_id is not None:
            count = event_id.rpartition("/")[2]
            assert int(count) == len(tokens), "an event id must count the tokens sent up to it"
            ids.append(event_id)
        if limit is not None and len(ids) >= limit:
            return False
    return False


def test_killed_server_resumes_every_stream_exactly(tmp_path):
    journal, log = tmp_path / "journal", tmp_path / "server.log"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(tmp_path / "a", journal, port, log, hold=f"{len(CASES)}:24")  # killed with both mid-way
    try:
        wait_healthy(url, server)
        got = {case: ([], []) for case in CASES}
        with httpx.Client(timeout=60) as client:
            streams = [client.stream("POST", f"{url}/v1/completions", json=_body(*case)) for case in CASES]
            responses = [s.__enter__() for s in streams]
            readers = [events(response) for response in responses]  # kept open until the kill
            for case, response, reader in zip(CASES, responses, readers, strict=True):
                assert response.status_code == 200
                assert not _read(reader, *got[case], limit=3), "the stream ended before the kill"
                assert len(got[case][0]) < MAX_TOKENS
            kill(server)
            for s in streams:
                with contextlib.suppress(httpx.HTTPError):
                    s.__exit__(None, None, None)
    finally:
        if server.poll() is None:
            kill(server)
    server = start_server(tmp_path / "b", journal, port, log)
    try:
        wait_healthy(url, server)
        assert "resumed 2 requests" in log.read_text()
        with httpx.Client(timeout=60) as client:
            for case in CASES:
                tokens, ids = got[case]
                seen = len(tokens)
                headers = {"Last-Event-ID": ids[-1]}
                with client.stream("POST", f"{url}/v1/completions", json=_body(*case), headers=headers) as response:
                    assert response.status_code == 200
                    assert _read(events(response), tokens, ids)
                assert seen < len(tokens)
            gone = client.post(f"{url}/v1/completions", json=_body(*CASES[0]), headers={"Last-Event-ID": "cmpl-x/3"})
            assert gone.status_code == 404 and "no stream" in gone.json()["error"]["message"]
    finally:
        kill(server)
    with tiny_runtime(tmp_path / "ref", scheduler="fixed") as rt:
        for prompt, temperature, seed in CASES:
            (expected,) = rt.generate(prompt, max_new_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                                      stop=list(rt.info.eos_token_ids))
            assert got[(prompt, temperature, seed)][0] == expected.tokens, (prompt, temperature)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
