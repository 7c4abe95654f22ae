"""One engine service behind the HTTP app, under uvicorn: what `dspark serve` runs once its engine is loaded
(tests run it on their own runtimes), in this process (with the request journal when given one) or in a
process of its own (`--engine-process`)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import click

from dspark.runtime.serving.app import ServerConfig

if TYPE_CHECKING:  # the engine-process server's front end runs without torch
    from dspark.runtime.api import Runtime


def serve_runtime(runtime: Runtime, config: ServerConfig, *, host: str, port: int, max_queue: int = 1024,
                  log_level: str = "info", journal_dir: str | None = None, journal_fsync: str = "interval",
                  source: str = "") -> None:
    """Serve `runtime` until interrupted. With `journal_dir`, the requests an earlier server left there resume
    first (one line on stderr says how many, and one per damaged record)."""
    from dspark.runtime.serving.service import EngineService

    store = None
    if journal_dir is not None:
        from dspark.runtime.recovery.journal import JournalStore

        store = JournalStore(journal_dir, fsync=journal_fsync)
    service = EngineService(runtime, max_queue=max_queue, max_new_tokens=config.max_tokens_per_request, store=store)
    try:
        if service.recovered is not None:
            r = service.recovered
            click.echo(f"dspark serve: journal {journal_dir}: resumed {len(r.running)} requests, kept "
                       f"{len(r.finished)} finished streams", err=True)
            for problem in r.problems:
                click.echo(f"dspark serve: journal: {problem}", err=True)
        _serve(service, config, host=host, port=port, max_queue=max_queue, log_level=log_level, source=source,
               slots=runtime.options.max_requests)
    finally:
        service.close()
        if store is not None:
            store.close()


def serve_engine_process(engine_dir: str, options: dict[str, Any], threads: int | None, config: ServerConfig, *,
                         host: str, port: int, max_queue: int = 1024, log_level: str = "info",
                         restarts: int = 3) -> None:
    """Serve the engine in `engine_dir` from a process of its own until interrupted (`restarts`: fresh engine
    processes for one that dies). `options`: `process_engine.load_runtime`'s (scheduler, RuntimeOptions
    fields); this process, the front end, never imports torch."""
    from dspark.runtime.serving.process_engine import load_runtime
    from dspark.runtime.serving.process_service import EngineProcessFailed, ProcessService

    try:
        service = ProcessService(functools.partial(load_runtime, engine_dir, threads, **options),
                                 max_queue=max_queue, max_new_tokens=config.max_tokens_per_request,
                                 max_restarts=restarts)
    except EngineProcessFailed as exc:
        raise click.ClickException(f"the engine process could not open {engine_dir}: {exc}") from None
    try:
        _serve(service, config, host=host, port=port, max_queue=max_queue, log_level=log_level,
               source=f"{engine_dir} (engine process {service.engine_pid})", slots=options["max_requests"])
    finally:
        service.close()


def _serve(service, config: ServerConfig, *, host: str, port: int, max_queue: int, log_level: str, source: str,
           slots: int) -> None:
    import uvicorn

    from dspark.runtime.serving.app import create_app

    app = create_app(service, config)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"dspark serve: model '{config.model_name}' from {source} on http://{shown}:{port} "
               "(/v1/completions, /v1/chat/completions, /metrics, /dashboard)", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                limit_concurrency=max_queue + slots + 64)
