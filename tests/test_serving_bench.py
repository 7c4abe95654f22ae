"""serve_bench's raw HTTP client (the http rows' default client) against a real uvicorn server: several
requests per keep-alive connection, every streamed token list equal to the direct engine's; and its SSE
reader on hand-made chunked bytes (events split across chunks and packed into one)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click
import pytest
from test_serving_support import running_server, tiny_runtime

from dspark.runtime.serving.app import ServerConfig, create_app
from dspark.runtime.serving.service import EngineService
from dspark.tools import serve_bench

PROMPTS = ("def parse_args(", "import os\n", "class Server:")


def test_raw_clients_keep_their_connection_and_get_the_direct_engines_outputs(tmp_path):
    with tiny_runtime(tmp_path) as rt, EngineService(rt) as service:
        app = create_app(service, ServerConfig(model_name="tiny", max_tokens_per_request=64))
        peers = []

        async def counting(scope, receive, send):
            if scope["type"] == "http" and scope["path"] == "/v1/completions":
                peers.append(tuple(scope["client"]))
            await app(scope, receive, send)

        work = serve_bench.jobs(3, 3, [rt.encode(p) for p in PROMPTS])
        with running_server(counting) as url:
            phase, outputs = serve_bench.run_raw(url, work, 8)
        direct, expected = serve_bench.run_direct(rt, work, 8, rt.info.eos_token_ids)
    assert outputs == expected and phase.tokens == direct.tokens > 0
    assert len(peers) == 9 and len(set(peers)) == 3  # three requests on each client's one connection
    assert len(phase.ttft) == 9 and all(t > 0 for t in phase.ttft)


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def read_events(data: bytes) -> tuple[list[bytes], bytes]:
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        events = [event async for event in serve_bench.sse_events(reader)]
        return events, await reader.read()

    return asyncio.run(go())


def test_sse_reader_joins_split_events_splits_packed_ones_and_stops_at_the_response_end():
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = chunked(b'data: {"a":1}\n\ndata: {"b"', b':2}\n\n', b'data: {"c":3}\n\ndata: [DONE]\n\n')
    events, rest = read_events(head + body + b"HTTP/1.1 200 OK\r\n")
    assert events == [b'data: {"a":1}', b'data: {"b":2}', b'data: {"c":3}', b"data: [DONE]"]
    assert rest == b"HTTP/1.1 200 OK\r\n"  # the next response on the connection is left for the next read


def test_sse_reader_refuses_an_error_answer_with_its_body():
    answer = b'HTTP/1.1 429 Too Many Requests\r\ncontent-length: 14\r\n\r\n{"error": "x"}'
    with pytest.raises(click.ClickException, match=r"429 Too Many Requests.*error"):
        read_events(answer)


def test_rows_are_the_median_repeat_with_the_lowest_ratio_beside_it():
    def phase(system, tokens):
        return serve_bench.Phase(system, 1, 1, tokens, 1.0, [0.1])

    rounds = [[phase("direct", 100), phase("service", 100), phase("http", 90)],
              [phase("direct", 300), phase("service", 200), phase("http", 150)],
              [phase("direct", 200), phase("service", 200), phase("http", 190)]]
    direct, service, http = serve_bench.summarise(rounds)
    assert (direct.tokens, direct.ratio) == (200, 1.0)  # the direct engine's median tok/s
    assert (http.tokens, http.ratio, http.min_ratio) == (90, 0.9, 0.5)  # ratios 0.9, 0.5, 0.95: median 0.9
    assert http.rounds == [0.5, 0.9, 0.95] and direct.rounds == [1.0] * 3
    assert http.service_ratio == 0.9 and service.service_ratio == 1.0  # over the service: 0.9, 0.75, 0.95
    assert "| 0.90 | 0.50 | 0.90 |" in serve_bench.table([http])  # vs direct, its min, vs service


def test_bench_runs_both_servers_interleaved_with_equal_outputs(tmp_path):
    """serve_bench with `dspark serve` (its engine in a process of its own) and `--in-process-engine` side by side
    on the demo engine: a row per system, no output differs."""
    import json

    from click.testing import CliRunner

    from dspark.tools.demo_engine import demo_engine_dir

    demo_engine_dir(show_progress=False)
    out = tmp_path / "rows.json"
    result = CliRunner().invoke(serve_bench.main, ["--clients", "2", "--requests", "4", "--per-client", "2",
                                                   "--max-tokens", "8", "--serve-args", "", "--serve-args",
                                                   "--in-process-engine", "--json", str(out), "--plot",
                                                   str(tmp_path / "serve.png")])
    assert result.exit_code == 0, result.output
    assert "differ" not in result.output
    rows = {row["system"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"direct", "service", "http", "http [--in-process-engine]"}
    assert all(row["requests"] == 4 and row["tokens"] > 0 for row in rows.values())
    assert rows["http"]["server_cpu_seconds"] > 0 and len(rows["http"]["vs_direct_rounds"]) == 1
    assert (tmp_path / "serve.png").read_bytes().startswith(b"\x89PNG")


def test_serve_engine_process_refuses_a_journal_and_reports_an_engine_it_cannot_open(tmp_path):
    from click.testing import CliRunner

    from dspark.tools.cli import main

    refused = CliRunner().invoke(main, ["serve", "--engine", str(tmp_path), "--engine-process", "--journal",
                                        str(tmp_path / "j")])
    assert refused.exit_code == 2 and "--engine-process" in refused.output and "Traceback" not in refused.output
    broken = CliRunner().invoke(main, ["serve", "--engine", str(tmp_path), "--engine-process", "--port", "0"])
    lines = broken.output.strip().splitlines()
    assert broken.exit_code == 2 and len(lines) == 1, broken.output
    assert lines[0].startswith("dspark serve: error: the engine process could not open"), lines


def test_dspark_serve_front_end_runs_without_torch():
    """`dspark serve` with its engine process: the server process (HTTP, tokenizer, metrics) never loads torch or
    ONNX Runtime, the engine process does; a completion, /metrics after a step, and /health go through."""
    import httpx

    from dspark.tools.demo_engine import demo_engine_dir

    engine = str(demo_engine_dir(show_progress=False))
    with serve_bench.running_server(engine, 4, 128, 8) as (url, server):
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "def main():", "max_tokens": 8}, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0
        assert "dspark:spec_decode_num_draft_tokens" in httpx.get(f"{url}/metrics", timeout=10).text
        assert httpx.get(f"{url}/health", timeout=10).json()["steps"] > 0

        def libraries(process):
            return {Path(m.path).name.split(".so")[0] for m in process.memory_maps() if ".so" in m.path}

        heavy = ("libtorch", "onnxruntime_pybind11_state")
        engines = [p for p in server.children() if any(lib.startswith(heavy) for lib in libraries(p))]
        front = libraries(server)
        assert len(engines) == 1 and "libtorch_cpu" in libraries(engines[0])
        assert not [lib for lib in front if lib.startswith(heavy)], sorted(front)


def test_the_front_ends_capacity_error_is_a_user_error():
    """The serving front end loads runtime/capacity.py without kv_cache.py: its CapacityError still gets the
    one-line treatment of a user's error, not a traceback."""
    import subprocess
    import sys

    code = ("import sys; from dspark.runtime.capacity import CapacityError; from dspark.tools.errors import "
            "user_error_types; assert 'dspark.runtime.kv_cache' not in sys.modules; "
            "assert CapacityError in user_error_types()")
    subprocess.run([sys.executable, "-c", code], check=True)
