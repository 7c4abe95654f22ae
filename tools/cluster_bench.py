"""Scale-out on Ray Serve, measured: aggregate tokens/s of `dspark serve` (one engine) and of the Ray Serve
fleet with 1 and 2 engine replicas, and the routing policies on a skewed workload, all in one run.

    python -m dspark.tools.cluster_bench [--engine DIR] [--clients 64] [--max-tokens 32] [--per-client 4]
        [--skew-requests 200] [--rate auto] [--repeats 3] [--seed 0] [--json out.json]

Systems (all up at once, idle ones wait; interleaved per repeat, the order rotated each repeat):
  serve   `dspark serve` in a subprocess: one engine, no Ray
  ray-1   the Ray Serve application (runtime/cluster) with one engine replica, route /one
  ray-2   the same with two engine replicas, route /two
Uniform phase: closed loop, `--clients` clients each sending `--per-client` greedy requests of `--max-tokens`
(serve_bench's prompts), streamed through a raw keep-alive HTTP client; outputs are checked equal across the
systems. Skewed phase, on ray-2, once per routing policy: `--skew-requests` requests arriving open-loop
(Poisson, fixed seed) at `--rate` per second (auto: 60% of the fleet's uniform-phase capacity), 85% short (a
prompt of ~10 tokens, 16 new) and 15% very long (~400 prompt tokens, 192 new); throughput and end-to-end
latency p50/p99, overall and per class. Rows: the median over repeats, the min beside it. The load average
is printed before and after (the machine is shared).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import click
import psutil

from .errors import OneLineErrors
from .serve_bench import PROMPTS, _quantile, running_server, sse_events

POLICIES = ("weighted", "round_robin", "power_of_two")  # runtime.cluster.routing.POLICIES, without importing Ray
LONG_SHARE, SHORT_NEW, LONG_NEW, LONG_PROMPT = 0.15, 16, 192, 400


@dataclass
class Outcome:
    """One request: when it was sent, its first token and its end (perf_counter), its tokens and class."""

    kind: str
    sent: float
    first: float | None = None
    end: float | None = None
    tokens: list[int] = field(default_factory=list)
    status: int = 200


async def stream_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, netloc: str, path: str,
                     body: dict, outcome: Outcome) -> None:
    """One streamed completion on an open keep-alive connection; fills `outcome`."""
    data = json.dumps({**body, "stream": True})
    writer.write(f"POST {path}/v1/completions HTTP/1.1\r\nHost: {netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
    async for event in sse_events(reader):
        if event.startswith(b"data: {"):
            payload = json.loads(event[6:])
            if "error" in payload:
                raise click.ClickException(f"stream error: {payload['error']['message']}")
            ids = (payload.get("dspark") or {}).get("token_ids") or []
            if ids and outcome.first is None:
                outcome.first = time.perf_counter()
            outcome.tokens += ids
    outcome.end = time.perf_counter()


def closed_loop(url: str, work: list[list[list[int]]], max_tokens: int) -> tuple[list[Outcome], float]:
    """Each client sends its prompts one after another on one connection; the outcomes and the wall time."""
    parts = urlsplit(url)
    outcomes: list[Outcome] = []

    async def client(prompts: list[list[int]]) -> None:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            for prompt in prompts:
                outcome = Outcome("uniform", time.perf_counter())
                outcomes.append(outcome)
                await stream_one(reader, writer, parts.netloc, parts.path, {"prompt": prompt, "max_tokens": max_tokens,
                                                                            "temperature": 0}, outcome)
        finally:
            writer.close()

    async def everyone() -> float:
        begin = time.perf_counter()
        await asyncio.gather(*(client(w) for w in work))
        return time.perf_counter() - begin

    return outcomes, asyncio.run(everyone())


def open_loop(url: str, requests: list[tuple[float, str, list[int], int]]) -> tuple[list[Outcome], float]:
    """Requests sent at their arrival times (offsets in s), each on its own connection."""
    parts = urlsplit(url)
    outcomes: list[Outcome] = []

    async def one(at: float, kind: str, prompt: list[int], max_tokens: int, begin: float) -> None:
        await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
        outcome = Outcome(kind, time.perf_counter())
        outcomes.append(outcome)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            await stream_one(reader, writer, parts.netloc, parts.path,
                             {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, outcome)
        finally:
            writer.close()

    async def everyone() -> float:
        begin = time.perf_counter()
        await asyncio.gather(*(one(*r, begin) for r in requests))
        return max(o.end for o in outcomes) - begin

    return outcomes, asyncio.run(everyone())


def skewed_requests(count: int, rate: float, seed: int, short: list[list[int]], filler: list[int],
                    vocab: int) -> list[tuple[float, str, list[int], int]]:
    """(arrival offset, kind, prompt ids, max_tokens): Poisson arrivals, 15% long, all fixed by the seed."""
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        if rng.random() < LONG_SHARE:
            start = rng.randrange(len(filler))
            prompt = [filler[(start + i) % len(filler)] for i in range(LONG_PROMPT)]
            prompt[0] = rng.randrange(vocab)  # no two long prompts alike
            out.append((at, "long", prompt, LONG_NEW))
        else:
            out.append((at, "short", short[rng.randrange(len(short))], SHORT_NEW))
    return out


def uniform_row(system: str, outcomes: list[Outcome], seconds: float) -> dict:
    tokens = sum(len(o.tokens) for o in outcomes)
    ttft = [o.first - o.sent for o in outcomes if o.first is not None]
    return {"system": system, "requests": len(outcomes), "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_second": round(tokens / seconds, 1), "ttft_p50_ms": round(1e3 * _quantile(ttft, 0.5), 1),
            "ttft_p99_ms": round(1e3 * _quantile(ttft, 0.99), 1)}


def skew_row(policy: str, outcomes: list[Outcome], seconds: float) -> dict:
    def lat(kind: str | None, q: float) -> float:
        values = [o.end - o.sent for o in outcomes if kind is None or o.kind == kind]
        return round(1e3 * _quantile(values, q), 1)

    tokens = sum(len(o.tokens) for o in outcomes)
    return {"policy": policy, "requests": len(outcomes), "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_second": round(tokens / seconds, 1), "p50_ms": lat(None, 0.5), "p99_ms": lat(None, 0.99),
            "short_p99_ms": lat("short", 0.99), "long_p50_ms": lat("long", 0.5), "long_p99_ms": lat("long", 0.99)}


def summarise(rows: list[dict], key: str, keep: tuple[str, ...]) -> list[dict]:
    """Per system/policy: the median of each figure over the repeats, and its min (…_min)."""
    out = []
    for name in dict.fromkeys(r[key] for r in rows):
        mine = [r for r in rows if r[key] == name]
        row = {key: name, "repeats": len(mine)}
        for k in keep:
            values = [r[k] for r in mine]
            row[k], row[f"{k}_min"] = round(statistics.median(values), 1), round(min(values), 1)
        out.append(row)
    return out


def table(rows: list[dict], key: str, columns: tuple[str, ...]) -> str:
    head = f"| {key} | " + " | ".join(f"{c} (median / min)" for c in columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    for r in rows:
        lines.append(f"| {r[key]} | " + " | ".join(f"{r[c]:g} / {r[c + '_min']:g}" for c in columns) + " |")
    return "\n".join(lines)


def ray_roles() -> dict[str, list]:
    """The Ray Serve processes by role (Ray titles its workers `ray::ServeReplica:APP:DEPLOYMENT...`)."""
    import psutil

    roles: dict[str, list] = {}
    for proc in psutil.process_iter(["cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        if title.startswith("ray::ProxyActor"):
            roles.setdefault("proxy", []).append(proc)
        elif title.startswith("ray::ServeReplica:"):
            app, deployment = title.split(":")[3:5]
            role = "ingress" if "ingress" in deployment else "engines"
            roles.setdefault(f"{app}/{role}", []).append(proc)
    return roles


def cpu_seconds(procs: list) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except Exception:  # gone
            pass
    return total


def start_fleet(engine_dir: str, max_requests: int, max_seq_len: int, max_tokens: int) -> dict[str, str]:
    """Ray (local) and Serve with the two applications; their URLs."""
    import ray
    from ray import serve

    from dspark.runtime.api import RuntimeOptions
    from dspark.runtime.cluster.deploy import build_app
    from dspark.runtime.cluster.replica import EngineSpec
    from dspark.runtime.serving.app import ServerConfig

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("RAY_worker_niceness", "0")  # Ray runs workers at nice 15: starved beside `dspark serve`
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = EngineSpec(engine_dir=engine_dir, options=RuntimeOptions(max_requests=max_requests,
                                                                    max_seq_len=max_seq_len))
    config = ServerConfig(model_name="bench", max_tokens_per_request=max_tokens)
    for name, replicas in (("one", 1), ("two", 2)):
        serve.run(build_app(spec, replicas=replicas, policy="weighted", config=config, max_queue=4096,
                            cpus_per_replica=0.5, poll_interval=0.1), name=name, route_prefix=f"/{name}")
    return {"ray-1": f"http://127.0.0.1:{port}/one", "ray-2": f"http://127.0.0.1:{port}/two"}


def set_policy(policy: str) -> None:
    from ray import serve

    serve.get_app_handle("two").set_policy.remote(policy).result()


@click.command(cls=OneLineErrors)
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False, path_type=str),
              help="Engine directory (default: the bundled demo pair's engine).")
@click.option("--clients", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--per-client", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--skew-requests", default=200, show_default=True, type=click.IntRange(min=10))
@click.option("--rate", default="auto", show_default=True, help="Skewed arrivals per second, or auto.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path))
def main(engine_dir, clients, per_client, max_tokens, skew_requests, rate, repeats, seed, json_out) -> None:
    """Ray Serve fleet vs `dspark serve`, and the routing policies on a skewed workload."""
    from dspark.runtime.api import Runtime

    if engine_dir is None:
        from dspark.tools.demo_engine import demo_engine_dir

        engine_dir = str(demo_engine_dir())
    load_before = os.getloadavg()
    with Runtime.load(engine_dir) as rt:
        short = [rt.encode(p) for p in PROMPTS]
        filler = [t for p in PROMPTS for t in rt.encode(p)]
        vocab, max_seq_len = min(rt.info.vocab_size, rt.tokenizer.vocab_size), 1024
    work = [[short[(c * per_client + k) % len(short)] for k in range(per_client)] for c in range(clients)]
    ceiling = max(max_tokens, LONG_NEW)
    urls = start_fleet(engine_dir, 64, max_seq_len, ceiling)
    uniform, skewed = [], []
    try:
        with running_server(engine_dir, 64, max_seq_len, ceiling) as (serve_url, server):
            urls = {"serve": serve_url, **urls}
            systems = list(urls)
            outputs: dict[str, list] = {}
            roles = {**ray_roles(), "serve": [server], "clients": [psutil.Process()]}
            for repeat in range(repeats):
                for system in systems[repeat % 3:] + systems[: repeat % 3]:
                    before = {role: cpu_seconds(procs) for role, procs in roles.items()}
                    outcomes, seconds = closed_loop(urls[system], work, max_tokens)
                    used = {role: round(cpu_seconds(procs) - before[role], 2) for role, procs in roles.items()}
                    uniform.append({**uniform_row(system, outcomes, seconds), "repeat": repeat, "cpu_seconds": used})
                    outputs.setdefault(system, sorted(tuple(o.tokens) for o in outcomes))
                    click.echo(f"uniform {system} repeat {repeat}: {uniform[-1]['tokens_per_second']} tok/s", err=True)
            if len({tuple(v) for v in outputs.values()}) != 1:
                click.echo("warning: outputs differ across systems", err=True)
        capacity = statistics.median(r["tokens_per_second"] for r in uniform if r["system"] == "ray-2")
        mean_new = LONG_SHARE * LONG_NEW + (1 - LONG_SHARE) * SHORT_NEW
        per_second = 0.6 * capacity / mean_new if rate == "auto" else float(rate)
        requests = skewed_requests(skew_requests, per_second, seed, short, filler, vocab)
        for repeat in range(repeats):
            for policy in POLICIES[repeat % 3:] + POLICIES[: repeat % 3]:
                set_policy(policy)
                outcomes, seconds = open_loop(urls["ray-2"], requests)
                skewed.append({**skew_row(policy, outcomes, seconds), "repeat": repeat})
                click.echo(f"skewed {policy} repeat {repeat}: p99 {skewed[-1]['p99_ms']} ms", err=True)
    finally:
        from ray import serve

        serve.shutdown()
    load_after = os.getloadavg()
    uniform_summary = summarise(uniform, "system", ("tokens_per_second", "ttft_p50_ms", "ttft_p99_ms"))
    skew_summary = summarise(skewed, "policy", ("tokens_per_second", "p50_ms", "p99_ms", "short_p99_ms",
                                                "long_p99_ms"))
    click.echo(f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} "
               f"{load_after[1]:.2f} ({os.cpu_count()} cores)")
    click.echo(f"\nuniform: {clients} clients x {per_client} requests x {max_tokens} tokens, greedy")
    click.echo(table(uniform_summary, "system", ("tokens_per_second", "ttft_p50_ms", "ttft_p99_ms")))
    click.echo(f"\nskewed on ray-2: {skew_requests} requests at {per_second:.1f}/s (seed {seed}), "
               f"{LONG_SHARE:.0%} long ({LONG_PROMPT} prompt, {LONG_NEW} new), the rest short ({SHORT_NEW} new)")
    click.echo(table(skew_summary, "policy", ("tokens_per_second", "p50_ms", "p99_ms", "short_p99_ms",
                                              "long_p99_ms")))
    click.echo("\np99 ms by repeat (the same arrivals in each repeat): " + "; ".join(
        f"{policy} " + " ".join(f"{r['p99_ms']:g}" for r in skewed if r["policy"] == policy) for policy in POLICIES))
    click.echo("\nCPU seconds by process during each uniform phase (median over repeats):")
    for system in dict.fromkeys(r["system"] for r in uniform):
        rows = [r["cpu_seconds"] for r in uniform if r["system"] == system]
        spent = {role: statistics.median(row[role] for row in rows) for role in rows[0]}
        click.echo(f"  {system}: " + ", ".join(f"{role} {value:.1f}" for role, value in spent.items() if value >= 0.1))
    if json_out is not None:
        json_out.write_text(json.dumps({"load_before": load_before, "load_after": load_after, "rate": per_second,
                                        "uniform": uniform, "skewed": skewed, "uniform_summary": uniform_summary,
                                        "skew_summary": skew_summary}, indent=1))


if __name__ == "__main__":
    main()
