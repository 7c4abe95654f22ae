"""The dspark C API: where its sources live, building it, and what it costs against the Python API.

    python -m dspark.tools.capi --cmake-dir     # -Ddspark_DIR=... : find_package(dspark) builds libdspark from there
    python -m dspark.tools.capi --include-dir   # dspark.h, dspark.hpp
    python -m dspark.tools.capi --build DIR [--sanitize address] [--cmake-arg -DX=Y]
                                                # libdspark + dspark_generate, installed into DIR
                                                # (lib/, include/, bin/, lib/cmake/dspark for find_package)
    python -m dspark.tools.capi --demo-engine   # the bundled demo engine's directory (built once)
    python -m dspark.tools.capi --bench [--engine DIR] [--clients 1,64] [--repeats 3]

The library is built against this Python (sys.executable): the interpreter it starts is this one, venv included.
`--bench` runs the same closed-loop workload (greedy, the serve bench's prompts, stopped at eos) through the
engine driven directly from Python (`direct`), the Python engine service read by asyncio clients (`service`) or
by one thread per client (`service-threads`), and the C API (dspark_generate, one C++ thread per client:
`capi-poll` waits with dspark_wait, `capi-callback` takes callbacks), interleaved, `--repeats` times; it prints
min and median tok/s and checks that every system's outputs equal the direct engine's. dspark_generate runs the
work once untimed first (--warmup), as the Python systems were warmed on it.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from dspark.runtime.capi import CAPI_DIR

from .errors import OneLineErrors


class BuildError(click.ClickException):
    """cmake failed; the message ends with the tail of its output."""


def toolchain_problem() -> str | None:
    """Why the C API cannot be built here (no cmake, no C or C++ compiler), or None."""
    if shutil.which("cmake") is None:
        return "cmake not found on PATH"
    cc, cxx = os.environ.get("CC", "cc"), os.environ.get("CXX", "c++")
    if shutil.which(cc) is None and shutil.which("gcc") is None:
        return f"no C compiler ({cc}) on PATH"
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        return f"no C++ compiler ({cxx}) on PATH"
    return None


def build(out: str | Path, *, sanitize: str | None = None, cmake_args: tuple[str, ...] = (), jobs: int = 2) -> Path:
    """Configure, build and install libdspark and dspark_generate into `out` (build tree in out/build); `out`."""
    out = Path(out).resolve()
    problem = toolchain_problem()
    if problem:
        raise BuildError(f"cannot build the C API: {problem}")
    configure = ["cmake", "-S", str(CAPI_DIR), "-B", str(out / "build"), f"-DDSPARK_PYTHON_EXECUTABLE={sys.executable}",
                 "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_INSTALL_PREFIX={out}", *cmake_args]
    if sanitize:
        configure += [f"-DDSPARK_SANITIZE={sanitize}", "-DCMAKE_BUILD_TYPE=RelWithDebInfo"]
    for command in (configure, ["cmake", "--build", str(out / "build"), f"-j{jobs}"],
                    ["cmake", "--install", str(out / "build")]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-30:])
            raise BuildError(f"{' '.join(command[:2])} failed (exit {done.returncode}):\n{tail}")
    return out


def generate_binary(prefix: Path) -> Path:
    return Path(prefix) / "bin" / "dspark_generate"


# -- bench -----------------------------------------------------------------------------------------------------
def run_capi(binary: Path, engine_dir: str, work: list[list[list[int]]], max_tokens: int, stop: list[int],
             slots: int, seq_len: int, callback: bool):
    """The work through dspark_generate --threads len(work): (Phase, outputs keyed (client, k))."""
    from .serve_bench import Phase

    clients = len(work)
    order = [(c, k) for k in range(max(map(len, work))) for c in range(clients) if k < len(work[c])]
    lines = "".join(" ".join(map(str, work[c][k])) + "\n" for c, k in order)  # thread c takes lines c, c+N, ...
    command = [str(binary), engine_dir, "--ids", "--threads", str(clients), "--max-new-tokens", str(max_tokens),
               "--max-requests", str(slots), "--max-seq-len", str(seq_len), "--warmup",
               *(["--callback"] if callback else [])]
    if stop:
        command += ["--stop", ",".join(map(str, stop))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torch's thread count there, as torch.set_num_threads(1) here
    done = subprocess.run(command, input=lines, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode:
        raise click.ClickException(f"dspark_generate failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    outputs = {key: [int(t) for t in line.split()] for key, line in zip(order, done.stdout.splitlines(), strict=True)}
    summary = dict(item.split("=", 1) for item in done.stderr.strip().splitlines()[-1].lstrip("# ").split())
    ttft = [float(ms) / 1e3 for ms in summary["ttft_ms"].split(",") if ms]
    system = "capi-callback" if callback else "capi-poll"
    return Phase(system, clients, len(outputs), int(summary["tokens"]), float(summary["seconds"]), ttft), outputs


def run_service_threads(runtime, work: list[list[list[int]]], max_tokens: int, stop: list[int]):
    """The work through the engine service, one Python thread per client streaming its requests (blocking
    `RequestHandle.stream()`): the Python counterpart of dspark_generate's client threads."""
    import threading

    from dspark.runtime.serving.service import EngineService

    from .serve_bench import Phase

    outputs, ttft = {}, []

    def client(service: EngineService, c: int) -> None:
        for k, prompt in enumerate(work[c]):
            sent, first, out = time.perf_counter(), None, []
            for chunk in service.submit(prompt, max_new_tokens=max_tokens, stop=stop).stream():
                first = first or time.perf_counter()
                out += chunk
            ttft.append(first - sent)
            outputs[(c, k)] = out

    with EngineService(runtime, max_queue=len(work) + 16) as service:
        threads = [threading.Thread(target=client, args=(service, c)) for c in range(len(work))]
        begin = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - begin
    return Phase("service-threads", len(work), len(outputs), sum(map(len, outputs.values())), seconds, ttft), outputs


def bench(engine_dir: str, clients: list[int], min_requests: int, max_tokens: int, repeats: int,
          build_dir: Path) -> list[dict]:
    import torch

    from dspark.runtime.api import Runtime, RuntimeOptions

    from .serve_bench import PROMPTS, jobs, run_direct, run_service

    torch.set_num_threads(1)  # as serve_bench: the direct engine's main thread would otherwise fan out
    binary = generate_binary(build(build_dir))
    slots, seq_len = max(clients), 256
    rows: dict[tuple[int, str], list[float]] = {}
    with Runtime.load(engine_dir, RuntimeOptions(max_requests=slots, max_seq_len=seq_len)) as runtime:
        prompts = [runtime.encode(p) for p in PROMPTS]
        stop = list(runtime.info.eos_token_ids)
        systems = {  # service-threads first: right after `direct` it runs at half speed here (not understood)
            "service-threads": lambda w: run_service_threads(runtime, w, max_tokens, stop),
            "direct": lambda w: run_direct(runtime, w, max_tokens, stop),
            "service": lambda w: run_service(runtime, w, max_tokens, stop),
            "capi-poll": lambda w: run_capi(binary, engine_dir, w, max_tokens, stop, slots, seq_len, False),
            "capi-callback": lambda w: run_capi(binary, engine_dir, w, max_tokens, stop, slots, seq_len, True),
        }
        for count in clients:  # warm up on the very work timed below, as dspark_generate --warmup does
            work = jobs(count, max(2, -(-min_requests // count)), prompts)
            systems["direct"](work), systems["service"](work), systems["service-threads"](work)
        for repeat in range(repeats):
            for count in clients:
                work = jobs(count, max(2, -(-min_requests // count)), prompts)
                done = {name: run(work) for name, run in systems.items()}
                reference = done["direct"][1]
                for name, (phase, outputs) in done.items():
                    differ = sum(outputs[key] != reference[key] for key in reference)
                    if differ:
                        click.echo(f"warning: {name}: {differ} outputs differ from the direct engine's", err=True)
                    rows.setdefault((count, name), []).append(phase.tokens_per_second)
                    click.echo(f"repeat {repeat + 1}, {count} clients: {name} {phase.tokens_per_second:.0f} tok/s",
                               err=True)
    order = ["direct", "service", "service-threads", "capi-poll", "capi-callback"]
    return [{"clients": count, "system": name, "tok_s": values, "min": min(values),
             "median": statistics.median(values)}
            for (count, name), values in sorted(rows.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1])))]


def table(rows: list[dict]) -> str:
    base = {(r["clients"]): r["median"] for r in rows if r["system"] == "direct"}
    lines = ["| clients | system | tok/s min | tok/s median | median vs direct |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['system']} | {r['min']:.0f} | {r['median']:.0f} "
                     f"| {r['median'] / base[r['clients']]:.2f} |")
    return "\n".join(lines)


@click.command("capi", cls=OneLineErrors)
@click.option("--cmake-dir", is_flag=True, help="Print the folder holding dsparkConfig.cmake (for dspark_DIR).")
@click.option("--include-dir", is_flag=True, help="Print the folder holding dspark.h and dspark.hpp.")
@click.option("--build", "build_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Build and install libdspark and dspark_generate into this folder.")
@click.option("--sanitize", help="With --build: -fsanitize= list (e.g. address,undefined).")
@click.option("--cmake-arg", "cmake_args", multiple=True, help="With --build: extra cmake argument (repeatable).")
@click.option("--demo-engine", is_flag=True, help="Print the bundled demo engine's folder (building it once).")
@click.option("--bench", "run_bench", is_flag=True, help="C API vs Python API tok/s on the same requests.")
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False, path_type=str),
              help="With --bench: engine or export directory (default: the demo engine).")
@click.option("--clients", default="1,64", show_default=True, help="With --bench: concurrent client counts.")
@click.option("--requests", "min_requests", default=64, show_default=True, type=click.IntRange(min=1),
              help="With --bench: at least this many requests per client count (at least 2 per client).")
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=str), help="Also write the rows here.")
def main(cmake_dir, include_dir, build_dir, sanitize, cmake_args, demo_engine, run_bench, engine_dir, clients,
         min_requests, max_tokens, repeats, json_out) -> None:
    """The dspark C API: locate, build, benchmark."""
    if cmake_dir or include_dir:
        click.echo(CAPI_DIR)
    if demo_engine:
        from .demo_engine import demo_engine_dir

        click.echo(demo_engine_dir())
    if build_dir:
        click.echo(generate_binary(build(build_dir, sanitize=sanitize, cmake_args=cmake_args)))
    if run_bench:
        if engine_dir is None:
            from .demo_engine import demo_engine_dir

            engine_dir = str(demo_engine_dir())
        with tempfile.TemporaryDirectory(prefix="dspark-capi-") as tmp:
            counts = [int(c) for c in clients.split(",") if c.strip()]
            rows = bench(engine_dir, counts, min_requests, max_tokens, repeats, Path(tmp))
        click.echo(f"engine {engine_dir}; greedy, {max_tokens} new tokens, closed-loop clients, {repeats} repeats\n")
        click.echo(table(rows))
        if json_out:
            Path(json_out).write_text(json.dumps(rows, indent=1))
    if not (cmake_dir or include_dir or demo_engine or build_dir or run_bench):
        raise click.UsageError("give --cmake-dir, --include-dir, --build DIR, --demo-engine or --bench")


if __name__ == "__main__":
    main()
