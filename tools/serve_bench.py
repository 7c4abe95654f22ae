"""What the server costs: time to first token (p50/p99) and aggregate tokens/s at 1, 64 and 256 concurrent
clients through HTTP, against the same engine driven directly in the same run.

    python -m dspark.tools.serve_bench [--engine DIR] [--clients 1,64,256] [--max-tokens 32] [--repeats 3]
        [--client raw,httpx] [--json out.json]

Three systems on one workload (closed loop: each client sends its next request when the last one ends;
greedy; the same prompts, stopped at eos), interleaved per client count and repeat:
  direct   one thread steps a BatchEngine and submits the next requests between steps (no threads, no HTTP)
  service  the EngineService (background loop thread) read by asyncio tasks in this process (no HTTP)
  http     `dspark serve` in a subprocess, read by streaming clients in this process (SSE): `raw`, a minimal
           asyncio HTTP/1.1 client on one keep-alive connection per client, or `httpx` (a new connection per
           request, see run_httpx)
TTFT is from submit (or sending the request) to the first token in hand; tok/s counts completion tokens
over the phase's wall time. On a small CPU the clients share the cores with the server, so the http rows
include the clients' own cost: the CPU column shows it (server + clients). Outputs are checked equal
across the systems. With repeats, a row is the repeat with the median ratio to the direct engine of the
same repeat, and the min ratio is shown beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import click
import psutil

from .errors import OneLineErrors
from .serve_bench_report import Phase, plot, summarise, table

PROMPTS = [
    "def parse_args(argv):", "class Server:\n    def __init__(self", "import os\nimport sys\n\ndef main(",
    "    for key, value in", "def read_config(path):\n    with open(path) as f:", "    if not isinstance(value,",
    "def __repr__(self):\n    return", "    except KeyError:\n", "class Node:\n    \"\"\"", "    return sorted(",
    "def copy(self):", "    self._lock = threading.", "def test_", "    raise ValueError(f\"",
    "from collections import", "def _split(text, sep=None):",
]


def jobs(clients: int, per_client: int, prompts: list[list[int]]) -> list[list[list[int]]]:
    """jobs[c]: the prompts client c sends, in order."""
    return [[prompts[(c * per_client + k) % len(prompts)] for k in range(per_client)] for c in range(clients)]


def run_direct(runtime, work: list[list[list[int]]], max_tokens: int, stop: Sequence[int]) -> tuple[Phase, dict]:
    engine = runtime.engine()
    inflight: dict[int, list] = {}  # request id -> [client, k, submitted, first token]
    next_k, ttft, outputs, tokens = [0] * len(work), [], {}, 0

    def start(c: int) -> None:
        k = next_k[c]
        next_k[c] += 1
        rid = engine.submit(work[c][k], max_new_tokens=max_tokens, stop_token_ids=stop)
        inflight[rid] = [c, k, time.perf_counter(), None]

    begin = time.perf_counter()
    for c in range(len(work)):
        start(c)
    while inflight:
        engine.step()
        now = time.perf_counter()
        for a in engine.active:
            record = inflight[a.result.request_id]
            if record[3] is None and a.result.tokens:
                record[3] = now
        for rid, result in engine.take_finished().items():
            c, k, submitted, first = inflight.pop(rid)
            ttft.append((first or now) - submitted)
            outputs[(c, k)], tokens = result.tokens, tokens + len(result.tokens)
            if next_k[c] < len(work[c]):
                start(c)
    return Phase("direct", len(work), len(outputs), tokens, time.perf_counter() - begin, ttft), outputs


def run_service(runtime, work: list[list[list[int]]], max_tokens: int, stop: Sequence[int]) -> tuple[Phase, dict]:
    from dspark.runtime.serving.service import EngineService

    outputs, ttft = {}, []

    async def client(service, c: int) -> None:
        for k, prompt in enumerate(work[c]):
            sent, first, out = time.perf_counter(), None, []
            async for chunk in service.submit(prompt, max_new_tokens=max_tokens, stop=stop).astream():
                first = first or time.perf_counter()
                out += chunk
            ttft.append(first - sent)
            outputs[(c, k)] = out

    async def everyone(service) -> None:
        await asyncio.gather(*(client(service, c) for c in range(len(work))))

    with EngineService(runtime, max_queue=len(work) + 16) as service:
        begin = time.perf_counter()
        asyncio.run(everyone(service))
        seconds = time.perf_counter() - begin
    return Phase("service", len(work), len(outputs), sum(map(len, outputs.values())), seconds, ttft), outputs


def run_raw(url: str, work: list[list[list[int]]], max_tokens: int) -> tuple[Phase, dict]:
    """Closed-loop SSE clients that cost the server's cores little: one keep-alive connection per client,
    requests written and chunked responses read with asyncio streams, one json.loads per event."""
    parts = urlsplit(url)
    outputs, ttft = {}, []

    async def client(c: int) -> None:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            for k, prompt in enumerate(work[c]):
                body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True})
                sent, first, out = time.perf_counter(), None, []
                writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: "
                             f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
                async for event in sse_events(reader):
                    if event.startswith(b"data: {"):
                        ids = (json.loads(event[6:]).get("dspark") or {}).get("token_ids") or []
                        if ids and first is None:
                            first = time.perf_counter()
                        out += ids
                ttft.append((first or time.perf_counter()) - sent)
                outputs[(c, k)] = out
        finally:
            writer.close()

    async def everyone() -> None:
        await asyncio.gather(*(client(c) for c in range(len(work))))

    begin = time.perf_counter()
    asyncio.run(everyone())
    seconds = time.perf_counter() - begin
    return Phase("http", len(work), len(outputs), sum(map(len, outputs.values())), seconds, ttft), outputs


async def sse_events(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The events of one streamed HTTP/1.1 response (status 200, chunked), each without its blank line;
    leaves the connection at the next response. ClickException for any other status."""
    status = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if not status.startswith(b"HTTP/1.1 200") or headers.get("transfer-encoding") != "chunked":
        body = await reader.read(int(headers.get("content-length", 0) or 0))
        raise click.ClickException(f"server answered {status.decode().strip()!r}: {body[:300]!r}")
    pending = b""
    while size := int(await reader.readline(), 16):
        pending += await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF
        *events, pending = pending.split(b"\n\n")
        for event in events:
            yield event
    await reader.readline()  # the CRLF after the last (empty) chunk


def run_httpx(url: str, work: list[list[list[int]]], max_tokens: int) -> tuple[Phase, dict]:
    """The same clients through httpx: about five times the raw client's CPU per request, on the cores the
    server needs (a new connection per request, see below)."""
    import httpx

    outputs, ttft = {}, []

    async def client(http, c: int) -> None:
        for k, prompt in enumerate(work[c]):
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            sent, first, out = time.perf_counter(), None, []
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise click.ClickException(f"server answered {response.status_code}: {await response.aread()}")
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        ids = (json.loads(line[6:]).get("dspark") or {}).get("token_ids") or []
                        if ids and first is None:
                            first = time.perf_counter()
                        out += ids
            ttft.append((first or time.perf_counter()) - sent)
            outputs[(c, k)] = out

    async def everyone() -> None:
        # No keep-alive: httpx 0.29 re-using a connection after a streamed response waits seconds before it
        # sends the next request (seen against a bare starlette app too; a raw asyncio client does not wait).
        limits = httpx.Limits(max_connections=len(work), max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as http:
            await asyncio.gather(*(client(http, c) for c in range(len(work))))

    begin = time.perf_counter()
    asyncio.run(everyone())
    seconds = time.perf_counter() - begin
    return Phase("http (httpx)", len(work), len(outputs), sum(map(len, outputs.values())), seconds, ttft), outputs


CLIENTS = {"raw": run_raw, "httpx": run_httpx}


@contextlib.contextmanager
def running_server(engine_dir: str, max_requests: int, max_seq_len: int, max_tokens: int,
                   extra: Sequence[str] = ()) -> Iterator[tuple[str, psutil.Process]]:
    """`dspark serve` (with `extra` arguments) in a subprocess on a free loopback port; yields its URL and
    process; stopped at exit."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = ["serve", "--engine", engine_dir, "--port", str(port), "--max-requests", str(max_requests),
            "--max-seq-len", str(max_seq_len), "--max-queue", "4096", "--max-tokens-per-request", str(max_tokens),
            "--log-level", "warning", *extra]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:  # not a pipe: a full pipe would stall the server
        server = subprocess.Popen([sys.executable, "-c", "from dspark.tools.cli import main; main()", *args],
                                  stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + 180
            while True:
                if server.poll() is not None:
                    log.seek(0)
                    raise click.ClickException(f"dspark serve exited: {log.read().decode()[-500:]}")
                if time.monotonic() > deadline:
                    raise click.ClickException("dspark serve did not come up within 180 s")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            yield url, psutil.Process(server.pid)
        finally:
            server.terminate()
            server.wait(30)


def timed(run, *args: object, server: psutil.Process | None = None) -> tuple[Phase, dict]:
    """run(*args) with the CPU seconds it took in this process (and in the server's, when given)."""
    def cpu(proc: psutil.Process, children: bool = False) -> float:  # a server's: with its engine process
        total = 0.0
        for p in [proc, *(proc.children(recursive=True) if children else ())]:
            with contextlib.suppress(psutil.NoSuchProcess):
                times = p.cpu_times()
                total += times.user + times.system
        return total

    me = psutil.Process()
    mine, theirs = cpu(me), cpu(server, True) if server is not None else 0.0
    phase, outputs = run(*args)
    phase.cpu_seconds = cpu(me) - mine
    if server is not None:
        phase.server_cpu_seconds = cpu(server, True) - theirs
    return phase, outputs


@click.command("serve-bench", cls=OneLineErrors)
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False, path_type=str),
              help="Engine or export directory (default: the bundled demo engine).")
@click.option("--clients", default="1,64,256", show_default=True, help="Concurrent client counts.")
@click.option("--requests", "min_requests", default=256, show_default=True, type=click.IntRange(min=1),
              help="At least this many requests per client count.")
@click.option("--per-client", default=16, show_default=True, type=click.IntRange(min=1),
              help="At least this many requests per client: a phase of a few requests each is mostly its ramp "
              "(every client's first prefill at once) and drain (the last clients alone), not the steady state.")
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(min=1),
              help="Interleaved rounds per client count (direct, service, http, direct, ...).")
@click.option("--client", "http_clients", default="raw", show_default=True,
              help="HTTP clients to run, comma-separated: raw (asyncio, keep-alive), httpx.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=str), help="Also write the rows here.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False, path_type=str),
              help="Also draw the ratios (every round a dot) and TTFT against the client count into this PNG.")
@click.option("--serve-args", multiple=True, default=[""], show_default=True,
              help="More `dspark serve` options for the http system, e.g. '--engine-process' (the engine loop in "
              "a process of its own) or '--replicas 1' (in a Ray replica process). Give it more than once to run "
              "one server per value, interleaved in the same rounds.")
def main(engine_dir, clients, min_requests, per_client, max_tokens, repeats, http_clients, json_out, plot_out,
         serve_args) -> None:
    """Server overhead: TTFT and tok/s through HTTP vs the engine driven directly."""
    import torch

    from dspark.runtime.api import Runtime, RuntimeOptions

    # The direct engine runs on this main thread, where torch's tiny ops fan out to every intra-op thread; the
    # service's loop thread (and the server's) run them on one. One thread here keeps the comparison fair.
    torch.set_num_threads(1)
    names = [c.strip() for c in http_clients.split(",") if c.strip()]
    if not names or any(c not in CLIENTS for c in names):
        raise click.BadParameter(f"{http_clients!r}: give some of {', '.join(CLIENTS)}", param_hint="--client")
    if engine_dir is None:
        from .demo_engine import demo_engine_dir

        engine_dir = str(demo_engine_dir())
    counts = [int(c) for c in clients.split(",") if c.strip()]
    slots, seq_len = max(counts), 256
    phases: list[Phase] = []
    with contextlib.ExitStack() as stack:
        servers = [(args, *stack.enter_context(running_server(engine_dir, slots, seq_len, max_tokens,
                                                                 shlex.split(args)))) for args in serve_args]
        runtime = stack.enter_context(Runtime.load(engine_dir, RuntimeOptions(max_requests=slots, max_seq_len=seq_len)))
        prompts = [runtime.encode(p) for p in PROMPTS]
        stop = runtime.info.eos_token_ids
        warm = jobs(2, 1, prompts)
        run_direct(runtime, warm, max_tokens, stop), run_service(runtime, warm, max_tokens, stop)
        for name in names:
            for _, url, _ in servers:
                CLIENTS[name](url, warm, max_tokens)
        for count in counts:
            work = jobs(count, max(per_client, -(-min_requests // count)), prompts)
            rounds = []
            for _ in range(repeats):
                done = [timed(run_direct, runtime, work, max_tokens, stop),
                        timed(run_service, runtime, work, max_tokens, stop)]
                for args, url, server in servers:
                    for name in names:
                        phase, outputs = timed(CLIENTS[name], url, work, max_tokens, server=server)
                        if len(servers) > 1 and args:
                            phase.system += f" [{args}]"
                        done.append((phase, outputs))
                differ = sum(done[0][1][key] != out[key] for _, out in done[1:] for key in done[0][1])
                if differ:  # greedy: only float noise between batch compositions could do this
                    click.echo(f"warning: {differ} outputs differ from the direct engine's at {count} clients",
                               err=True)
                rounds.append([phase for phase, _ in done])
                click.echo(f"{count} clients: " + ", ".join(f"{p.system} {p.tokens_per_second:.0f} tok/s"
                                                             for p, _ in done), err=True)
            phases += summarise(rounds)
    shown = [args for args in serve_args if args]
    click.echo(f"engine {engine_dir}; greedy, {max_tokens} new tokens, closed-loop clients, {repeats} repeat(s)"
               + (f"; dspark serve {' | '.join(shown)}" if shown else "") + "\n")
    click.echo(table(phases))
    if plot_out:
        title = (f"dspark serve against the engine driven directly ({repeats} rounds, {max_tokens} new tokens, "
                 "closed-loop clients)")
        plot(phases, Path(plot_out), title)
        click.echo(f"plot: {plot_out}")
    if json_out:
        Path(json_out).write_text(json.dumps([{**p.row(), "ttft_seconds": p.ttft} for p in phases], indent=1))


if __name__ == "__main__":
    main()
