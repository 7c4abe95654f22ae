"""What the server costs: time to first token (p50/p99) and aggregate tokens/s at 1, 64 and 256 concurrent
clients through HTTP, against the same engine driven directly in the same run.

    python -m dspark.tools.serve_bench [--engine DIR] [--clients 1,64,256] [--max-tokens 32] [--json out.json]

Three systems on one workload (closed loop: each client sends its next request when the last one ends;
greedy; the same prompts, stopped at eos), interleaved per client count:
  direct   one thread steps a BatchEngine and submits the next requests between steps (no threads, no HTTP)
  service  the EngineService (background loop thread) read by asyncio tasks in this process (no HTTP)
  http     `dspark serve` in a subprocess, read by httpx streaming clients in this process (SSE)
TTFT is from submit (or sending the request) to the first token in hand; tok/s counts completion tokens
over the phase's wall time. On a small CPU the clients share the cores with the server, so the http row
includes the clients' own cost. Outputs are checked equal across the three systems.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import click

from .errors import OneLineErrors

PROMPTS = [
    "def parse_args(argv):", "class Server:\n    def __init__(self", "import os\nimport sys\n\ndef main(",
    "    for key, value in", "def read_config(path):\n    with open(path) as f:", "    if not isinstance(value,",
    "def __repr__(self):\n    return", "    except KeyError:\n", "class Node:\n    \"\"\"", "    return sorted(",
    "def copy(self):", "    self._lock = threading.", "def test_", "    raise ValueError(f\"",
    "from collections import", "def _split(text, sep=None):",
]


@dataclass
class Phase:
    system: str
    clients: int
    requests: int
    tokens: int
    seconds: float
    ttft: list[float]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def row(self) -> dict:
        return {"system": self.system, "clients": self.clients, "requests": self.requests, "tokens": self.tokens,
                "seconds": round(self.seconds, 3), "tokens_per_second": round(self.tokens_per_second, 1),
                "ttft_p50_ms": round(1e3 * _quantile(self.ttft, 0.5), 2),
                "ttft_p99_ms": round(1e3 * _quantile(self.ttft, 0.99), 2)}


def _quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else float("nan")


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


def run_http(url: str, work: list[list[list[int]]], max_tokens: int) -> tuple[Phase, dict]:
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
    return Phase("http", len(work), len(outputs), sum(map(len, outputs.values())), seconds, ttft), outputs


@contextlib.contextmanager
def running_server(engine_dir: str, max_requests: int, max_seq_len: int, max_tokens: int) -> Iterator[str]:
    """`dspark serve` in a subprocess on a free loopback port; yields its URL; stopped at exit."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = ["serve", "--engine", engine_dir, "--port", str(port), "--max-requests", str(max_requests),
            "--max-seq-len", str(max_seq_len), "--max-queue", "4096", "--max-tokens-per-request", str(max_tokens),
            "--log-level", "warning"]
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
            yield url
        finally:
            server.terminate()
            server.wait(30)


def table(phases: list[Phase]) -> str:
    direct = {p.clients: p for p in phases if p.system == "direct"}
    lines = ["| clients | system | requests | TTFT p50 ms | TTFT p99 ms | tok/s | tok/s vs direct | overhead |",
             "|---|---|---|---|---|---|---|---|"]
    for p in phases:
        row, ratio = p.row(), p.tokens_per_second / direct[p.clients].tokens_per_second
        lines.append(f"| {p.clients} | {p.system} | {p.requests} | {row['ttft_p50_ms']:.1f} | {row['ttft_p99_ms']:.1f} "
                     f"| {row['tokens_per_second']:.0f} | {ratio:.2f} | {100 * (1 - ratio):+.0f} % |")
    return "\n".join(lines)


@click.command("serve-bench", cls=OneLineErrors)
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False, path_type=str),
              help="Engine or export directory (default: the bundled demo engine).")
@click.option("--clients", default="1,64,256", show_default=True, help="Concurrent client counts.")
@click.option("--requests", "min_requests", default=256, show_default=True, type=click.IntRange(min=1),
              help="At least this many requests per client count (at least 2 per client).")
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=str), help="Also write the rows here.")
def main(engine_dir, clients, min_requests, max_tokens, json_out) -> None:
    """Server overhead: TTFT and tok/s through HTTP vs the engine driven directly."""
    import torch

    from dspark.runtime.api import Runtime, RuntimeOptions

    # The direct engine runs on this main thread, where torch's tiny ops fan out to every intra-op thread; the
    # service's loop thread (and the server's) run them on one. One thread here keeps the comparison fair.
    torch.set_num_threads(1)
    if engine_dir is None:
        from .demo_engine import demo_engine_dir

        engine_dir = str(demo_engine_dir())
    counts = [int(c) for c in clients.split(",") if c.strip()]
    slots, seq_len = max(counts), 256
    phases: list[Phase] = []
    with running_server(engine_dir, slots, seq_len, max_tokens) as url, \
            Runtime.load(engine_dir, RuntimeOptions(max_requests=slots, max_seq_len=seq_len)) as runtime:
        prompts = [runtime.encode(p) for p in PROMPTS]
        stop = runtime.info.eos_token_ids
        warm = jobs(2, 1, prompts)
        run_direct(runtime, warm, max_tokens, stop), run_service(runtime, warm, max_tokens, stop)
        run_http(url, warm, max_tokens)
        for count in counts:
            work = jobs(count, max(2, -(-min_requests // count)), prompts)
            done = [run_direct(runtime, work, max_tokens, stop), run_service(runtime, work, max_tokens, stop),
                    run_http(url, work, max_tokens)]
            differ = sum(done[0][1][key] != out[key] for _, out in done[1:] for key in done[0][1])
            if differ:  # greedy: only float noise between batch compositions could do this
                click.echo(f"warning: {differ} outputs differ from the direct engine's at {count} clients", err=True)
            phases += [phase for phase, _ in done]
            click.echo(f"{count} clients: " + ", ".join(f"{p.system} {p.tokens_per_second:.0f} tok/s"
                                                         for p, _ in done), err=True)
    click.echo(f"engine {engine_dir}; greedy, {max_tokens} new tokens, closed-loop clients\n")
    click.echo(table(phases))
    if json_out:
        Path(json_out).write_text(json.dumps([{**p.row(), "ttft_seconds": p.ttft} for p in phases], indent=1))


if __name__ == "__main__":
    main()
