"""`dspark serve`: the OpenAI-compatible HTTP server (uvicorn + starlette) over one engine service."""

from __future__ import annotations

import click

from .errors import OneLineErrors

_DIR = click.Path(exists=True, file_okay=False, path_type=str)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@click.command("serve", cls=OneLineErrors)
@click.option("--engine", "engine_dir", type=_DIR,
              help="Engine or dspark-export directory. Default: the bundled demo pair (built on first use).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback unless told).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", envvar="DSPARK_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1 "
                                                          "(or set DSPARK_API_KEY).")
@click.option("--max-queue", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Requests waiting for a slot before new ones get 429.")
@click.option("--max-tokens-per-request", default=512, show_default=True, type=click.IntRange(min=1),
              help="Largest max_tokens a request may ask for.")
@click.option("--max-requests", default=64, show_default=True, type=click.IntRange(min=1),
              help="Requests decoded together (KV cache slots).")
@click.option("--max-seq-len", default=1024, show_default=True, type=click.IntRange(min=8),
              help="Positions per KV slot: prompt + new tokens + one draft block.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(min=1024),
              help="Largest request body.")
@click.option("--model-name", help="The model id clients send (default: the engine directory's name).")
@click.option("--scheduler", default="dspark", show_default=True,  # prefix_scheduler.MODES (no torch import here)
              type=click.Choice(["dspark", "async", "fixed", "threshold", "off"]),
              help="dspark: Algorithm 1; async: its §5.2 form, batch size from the confidences of two steps earlier.")
@click.option("--prompt-lookup", default=3, show_default=True, type=click.IntRange(min=0),
              help="--scheduler dspark: requests may verify what followed their last N tokens earlier "
                   "instead of a DSpark block, where that is expected to pay; 0: off.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("--host-kv-tokens", default=0, show_default=True, type=click.IntRange(min=0),
              help="KV positions a host tier holds for requests swapped out of the slots under pressure (0: none; "
                   "requests then wait for a slot).")
@click.option("--journal", "journal_dir", type=click.Path(file_okay=False, path_type=str),
              help="Keep every request's snapshot here; restarted with the same directory, the server resumes the "
                   "requests it was running, and clients reconnect with Last-Event-ID (docs/recovery.md).")
@click.option("--journal-fsync", default="interval", show_default=True,
              type=click.Choice(["step", "interval", "never"]),
              help="When the journal reaches the disk: every step, once a second, or when the OS likes. A killed "
                   "server loses nothing under any of them; a power cut loses what was not flushed.")
@click.option("--replicas", default=0, show_default=True, type=click.IntRange(min=0),
              help="Run N engine replicas on Ray Serve behind this endpoint (0: one engine in this process).")
@click.option("--routing", default="weighted", show_default=True,  # cluster.routing.POLICIES
              type=click.Choice(["weighted", "round_robin", "power_of_two"]),
              help="With --replicas: weighted by expected cost (prompt, max_tokens, replica load), or the plain ones.")
@click.option("--ray-address", help="With --replicas: an existing Ray cluster ('auto', 'ray://HOST:10001'); "
                                    "default: start a local one.")
@click.option("--cpus-per-replica", default=1.0, show_default=True, type=click.FloatRange(min=0),
              help="With --replicas: Ray CPUs each engine replica reserves.")
@click.option("--engine-process/--in-process-engine", default=None,
              help="Run the engine loop in a process of its own: the HTTP front end and the engine's Python on two "
                   "cores instead of one interpreter lock (the default, except with --journal, which keeps the "
                   "engine in the server's process).")
@click.option("--engine-restarts", default=3, show_default=True, type=click.IntRange(min=0),
              help="With the engine in its own process: how many times a fresh one replaces an engine process that "
                   "died (the requests that had no token yet go to it; those that had fail).")
@click.option("--threads", type=click.IntRange(min=0), help="ONNX Runtime intra-op threads (0: every core; "
              "default: the engine's own count, the one its SPS table was measured with).")
def serve(engine_dir, host, port, api_key, max_queue, max_tokens_per_request, max_requests, max_seq_len,
          max_body_bytes, model_name, scheduler, prompt_lookup, log_level, replicas, routing, ray_address,
          cpus_per_replica, journal_dir, journal_fsync, host_kv_tokens, engine_process, engine_restarts,
          threads) -> None:
    """Serve /v1/completions and /v1/chat/completions (OpenAI protocol), /metrics and /dashboard."""
    try:
        import uvicorn  # noqa: F401 - fail now, with the fix, not after loading the engine
    except ImportError:
        raise click.ClickException("the server needs uvicorn and starlette: pip install 'dspark[serve]'") from None
    if engine_process is None:
        engine_process = not journal_dir and not replicas
    if engine_process and (journal_dir or replicas):
        raise click.UsageError("--engine-process runs one engine without a journal: leave out --journal and "
                               "--replicas (which runs its engines in Ray processes)")
    if replicas and journal_dir:
        raise click.UsageError("--journal keeps one in-process engine's requests; with --replicas there is no "
                               "replica snapshot store yet (docs/recovery.md)")
    from pathlib import Path

    from dspark.runtime.serving.app import ServerConfig

    if engine_dir is None:
        from dspark.tools.demo_engine import demo_engine_dir

        engine_dir, model_name = str(demo_engine_dir()), model_name or "dspark-demo"
    model_name = model_name or Path(engine_dir).resolve().name
    if host not in _LOOPBACK and api_key is None:
        click.echo(f"dspark serve: warning: listening on {host} without --api-key", err=True)
    fields = dict(max_requests=max_requests, max_seq_len=max_seq_len, host_kv_tokens=host_kv_tokens)
    config = ServerConfig(model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                          max_tokens_per_request=max_tokens_per_request)
    if engine_process:  # this process stays the front end: no torch here, the engine process has it
        from dspark.tools.serve_engine import serve_engine_process

        opener = {"scheduler": scheduler, "prompt_lookup": prompt_lookup, **fields}
        serve_engine_process(engine_dir, opener, threads, config, host=host, port=port,
                             max_queue=max_queue, log_level=log_level, restarts=engine_restarts)
        return
    from dspark.runtime.api import Runtime, RuntimeOptions
    from dspark.runtime.prefix_scheduler import SchedulerConfig

    options = RuntimeOptions(scheduler=SchedulerConfig(scheduler, prompt_lookup=prompt_lookup), **fields)
    if replicas:
        from dspark.runtime.cluster.launch import serve_replicas
        from dspark.runtime.cluster.replica import EngineSpec

        try:
            serve_replicas(EngineSpec(engine_dir=str(Path(engine_dir).resolve()), options=options, threads=threads),
                           replicas=replicas,
                           policy=routing, config=config, host=host, port=port, max_queue=max_queue,
                           cpus_per_replica=cpus_per_replica, address=ray_address,
                           announce=lambda line: click.echo(f"dspark serve: model '{model_name}': {line}", err=True))
        except ImportError as exc:
            raise click.ClickException(str(exc)) from None
        return
    from dspark.tools.serve_engine import serve_runtime

    try:
        runtime = Runtime.load(engine_dir, options, threads=threads)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    with runtime:
        serve_runtime(runtime, config, host=host, port=port, max_queue=max_queue, log_level=log_level,
                      journal_dir=journal_dir, journal_fsync=journal_fsync, source=engine_dir)
