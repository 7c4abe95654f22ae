"""The OpenAI-compatible HTTP app (starlette) over an `EngineService`.

    POST /v1/completions, /v1/chat/completions   whole responses or SSE streams ending in `data: [DONE]`
    GET  /v1/models, /health, /metrics, /dashboard

Outputs are the engine's: the same seed gives the same tokens as `Runtime.generate` (text is decoded by the
same `runtime.text` rules, cut at the same token). Every refusal is an OpenAI error object with a 4xx
status: bad JSON or types 400, unknown fields 400 naming them, prompt + max_tokens beyond the engine 400,
bodies over `max_body_bytes` 413, a wrong API key 401, the queue full 429 with Retry-After. A client that
goes away cancels its request; its KV slot is free at the next step. `--api-key` guards /v1 only.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ..capacity import CapacityError
from ..requests import RequestError
from ..text import TOKENIZER_FILE, TextCodec, TextStream, cut_text
from . import protocol as P
from .dashboard import dashboard_routes
from .handle import QueueFull, RequestFailed, RequestHandle, ServiceClosed
from .metrics import ServingMetrics

if TYPE_CHECKING:  # the front end of an engine process serves a ProcessService, without torch
    from .service import EngineService

log = logging.getLogger("dspark.serving")
_OFF_LOOP_BYTES = 8192  # tokenize bodies larger than this in a worker thread, not on the event loop


@dataclass(frozen=True)
class ServerConfig:
    model_name: str = "dspark"
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_tokens_per_request: int = 512
    default_completion_tokens: int = 16  # OpenAI's default for /v1/completions; chat defaults to what fits


class _SSE(Response):
    """An SSE stream (one `send` per event) that cancels its request whenever it ends: finished, or the client
    went away (a plain task watches for the disconnect; the request then ends at the next step, and so does
    the stream). Not starlette's StreamingResponse, which opens an anyio task group per response and, on
    leaving it, a cancel scope that formats the task's repr: event-loop time taken from the engine thread."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], handle: RequestHandle) -> None:
        self.events, self.handle, self.background = events, handle, None
        self.status_code = 200
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watcher = asyncio.ensure_future(self._cancel_on_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self.handle.cancel()

    async def _cancel_on_disconnect(self, receive: Any) -> None:
        await _disconnect(receive)
        self.handle.cancel()


class OpenAIServer:
    """The routes' state: the service, the tokenizer (None: token ids only), limits and key."""

    def __init__(self, service: EngineService, config: ServerConfig) -> None:
        self.service, self.config = service, config
        self.codec = _codec_or_none(service)
        self.started = int(time.time())

    # -- endpoints --------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        alive = self.service.alive
        return JSONResponse({"status": "ok" if alive else "down", "model": self.config.model_name,
                             **asdict(self.service.snapshot())}, status_code=200 if alive else 503)

    # -- generation -------------------------------------------------------------------------------
    async def _generate(self, request: Request, *, chat: bool) -> Response:
        self._authorize(request)
        journal = getattr(self.service, "journal", None)
        if journal is not None and (last := request.headers.get("last-event-id")) is not None:
            return self._reconnect(journal, last, chat)
        raw = await self._read_body(request)
        body = P.parse_json(raw)
        limit = self.config.max_tokens_per_request
        req = P.chat_request(body, limit) if chat else P.completion_request(body, limit)
        self._check_model(req.model)
        prompt_ids = await self._prompt_ids(req, large=len(raw) > _OFF_LOOP_BYTES)
        room = self.service.room(len(prompt_ids))
        if room < 1:
            raise P.bad(f"the prompt ({len(prompt_ids)} tokens) leaves no room for new tokens on this server",
                        "messages" if chat else "prompt")
        default = room if chat else min(room, self.config.default_completion_tokens)
        max_tokens = req.max_tokens or default
        seed = req.seed if req.seed is not None else P.random_seed()
        rid, created = P.new_id(chat), int(time.time())
        # a journaled service keeps the body: a reconnecting client's stream is rendered from it again
        context = {"body": raw.decode("utf-8", "replace"), "created": created} if journal is not None else None
        handle = self._submit(req, prompt_ids, max_tokens, seed, key=rid, context=context)
        echo = self._echo_text(req, prompt_ids)
        if req.stream:
            return _SSE(self._events(req, handle, rid, len(prompt_ids), echo, seed), handle)
        result = await _result_unless_gone(request, handle)
        if result is None:
            return Response(status_code=499)  # the client closed the connection; nobody reads this
        text = echo + self._text(result.tokens, req)
        return JSONResponse(P.response(req, rid, self.config.model_name, text, _finish(result.finish_reason),
                                       P.usage(len(prompt_ids), len(result.tokens)), _extras(result, seed)))

    def _submit(self, req: P.ServeRequest, prompt_ids: list[int], max_tokens: int, seed: int, *,
                key: str | None = None, context: dict | None = None) -> RequestHandle:
        if req.stop_strings and self.codec is None:
            raise P.bad("stop strings need the model's tokenizer.json, which this engine lacks; give token ids",
                        "stop")
        stop = [*req.stop_ids, *req.stop_strings, *self.service.runtime.info.eos_token_ids]  # eos always ends
        journaled = {"key": key, "context": context} if context is not None else {}
        try:
            return self.service.submit(prompt_ids, max_new_tokens=max_tokens, temperature=req.temperature, seed=seed,
                                       stop=stop, **journaled)
        except QueueFull as exc:
            raise P.ApiError(429, str(exc), kind="rate_limit_error", code="queue_full",
                             headers={"Retry-After": str(exc.retry_after)}) from None
        except (RequestError, CapacityError) as exc:
            raise P.bad(str(exc), _param_of(str(exc))) from None
        except ServiceClosed as exc:
            raise P.ApiError(503, str(exc), kind="server_error") from None

    async def _events(self, req: P.ServeRequest, handle: RequestHandle, rid: str, prompt_len: int, echo: str,
                      seed: int, *, start: int | None = None, created: int | None = None) -> Any:
        """The SSE events; with a journal each carries `id: RID/N` (N: tokens sent up to it), and `start`
        resumes after the first `start` tokens (a reconnect: the opening chunk was sent before)."""
        model, created = self.config.model_name, created or int(time.time())
        stream = TextStream(self.codec, req.stop_strings) if self.codec is not None else None
        chunks = P.TokenChunks(req, rid, model, created)
        sent, ids = start or 0, handle.key is not None
        if stream is not None and sent:
            stream.push(handle.tokens()[:sent])  # the text the client has: what follows continues it
        if (req.chat or echo) and start is None:
            yield _event_id(rid, 0, ids) + P.sse(P.chunk(req, rid, model, created, text=echo, role=req.chat))
        try:
            async for tokens in handle.astream(sent):
                sent += len(tokens)
                yield _event_id(rid, sent, ids) + chunks.render(stream.push(tokens) if stream is not None else "",
                                                                tokens)
            result = handle.result(0)
        except (RequestFailed, ServiceClosed) as exc:
            yield P.sse(P.ApiError(500, str(exc), kind="server_error").body()) + P.sse("[DONE]")
            return
        rest = stream.finish(self._text(result.tokens, req)) if stream is not None else ""
        tail = P.sse(P.chunk(req, rid, model, created, text=rest, finish_reason=_finish(result.finish_reason),
                             extras=_extras(result, seed, with_ids=False)))
        if req.include_usage:
            tail += P.sse(P.chunk(req, rid, model, created, usage_=P.usage(prompt_len, len(result.tokens))))
        yield _event_id(rid, len(result.tokens), ids) + tail + P.sse("[DONE]")  # one write for the last events

    def _reconnect(self, journal: Any, last_event_id: str, chat: bool) -> Response:
        """A client that lost its stream (the server restarted, the connection broke) sends the same request
        with `Last-Event-ID: RID/N`: it gets the stream's events after its first N tokens."""
        rid, _, count = last_event_id.strip().rpartition("/")
        handle = journal.find(rid) if count.isdigit() else None
        if handle is None:
            raise P.ApiError(404, f"no stream '{last_event_id[:120]}' here to resume (Last-Event-ID is RID/N from "
                                  "an event of this server; finished streams are kept a while, then forgotten)",
                             code="stream_not_found")
        body = json.loads(handle.context["body"])
        limit = self.config.max_tokens_per_request
        req = P.chat_request(body, limit) if chat else P.completion_request(body, limit)
        return _SSE(self._events(req, handle, rid, len(handle.prompt_ids), "", handle.seed, start=int(count),
                                 created=handle.context.get("created")), handle)

    # -- pieces -----------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise P.ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                             kind="authentication_error", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise P.ApiError(413 if length.isdigit() else 400, f"request body over {limit} bytes"
                             if length.isdigit() else "bad Content-Length header")
        chunks, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise P.ApiError(413, f"request body over {limit} bytes")
            chunks.append(part)
        return b"".join(chunks)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise P.ApiError(404, f"model '{model[:100]}' is not served here (this server serves "
                                  f"'{self.config.model_name}')", param="model", code="model_not_found")

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.config.model_name, "object": "model", "created": self.started, "owned_by": "dspark",
                "max_model_len": self.service.runtime.info.max_positions}

    async def _prompt_ids(self, req: P.ServeRequest, *, large: bool) -> list[int]:
        if isinstance(req.prompt, list):
            return req.prompt
        if self.codec is None:
            raise P.bad(f"this engine has no {TOKENIZER_FILE}: send the prompt as token ids",
                        "messages" if req.chat else "prompt")
        codec = self.codec

        def encode() -> list[int]:
            return codec.encode_chat(req.messages) if req.chat else codec.encode(req.prompt)

        try:
            return await anyio.to_thread.run_sync(encode) if large else encode()
        except RequestError as exc:
            raise P.bad(str(exc), "messages" if req.chat else "prompt") from None

    def _echo_text(self, req: P.ServeRequest, prompt_ids: list[int]) -> str:
        if not req.echo:
            return ""
        if isinstance(req.prompt, str):
            return req.prompt
        return self.codec.decode(prompt_ids) if self.codec is not None else ""

    def _text(self, tokens: list[int], req: P.ServeRequest) -> str:
        return cut_text(self.codec.decode(tokens), req.stop_strings) if self.codec is not None else ""


async def _result_unless_gone(request: Request, handle: RequestHandle) -> Any:
    """The request's result, or None (after cancelling it) when the client disconnects first."""
    result = asyncio.ensure_future(handle.aresult())
    gone = asyncio.ensure_future(_disconnect(request.receive))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not result.done():
        result.cancel()
        handle.cancel()
        return None
    try:
        return result.result()
    except (RequestFailed, ServiceClosed) as exc:
        raise P.ApiError(503 if isinstance(exc, ServiceClosed) else 500, str(exc), kind="server_error") from None


async def _disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _event_id(rid: str, tokens: int, journaled: bool) -> bytes:
    return f"id: {rid}/{tokens}\n".encode() if journaled else b""


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _extras(result: Any, seed: int, with_ids: bool = True) -> dict[str, Any]:
    """dspark's own numbers, apart from the OpenAI fields."""
    extras = {"seed": seed, "finish_reason": result.finish_reason, "rounds": result.rounds,
              "mean_accepted_length": result.mean_acceptance_length, "verified_tokens": result.verified_tokens,
              "acceptance_lengths": result.acceptance_lengths}
    return {"token_ids": result.tokens, **extras} if with_ids else extras


def _param_of(message: str) -> str | None:
    for word, param in (("max_new_tokens", "max_tokens"), ("stop", "stop"), ("prompt", "prompt"),
                        ("temperature", "temperature"), ("seed", "seed")):
        if word in message:
            return param
    return None


def _codec_or_none(service: EngineService) -> TextCodec | None:
    """The tokenizer when the engine has one (a broken one is an ArtifactError at start-up), else None."""
    runtime = service.runtime
    if not any((d / TOKENIZER_FILE).is_file() for d in runtime.text_dirs):
        return None
    return runtime.tokenizer


def _error_response(request: Request, exc: Exception) -> Response:
    if isinstance(exc, P.ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
    if isinstance(exc, HTTPException):
        error = P.ApiError(exc.status_code, exc.detail or "error", kind="invalid_request_error")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)
    log.error("unhandled error serving %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(P.ApiError(500, "internal server error", kind="server_error").body(), status_code=500)


def create_app(service: EngineService, config: ServerConfig | None = None, *,
               metrics: ServingMetrics | None = None, observability: list[BaseRoute] | None = None) -> Starlette:
    """The app over a running service. `metrics`: the ServingMetrics behind /metrics and /dashboard (made
    here, subscribed to the service, when None). `observability`: routes that replace those two (the Ray
    cluster's ingress serves the replicas' metrics through its duck-typed service, runtime/cluster/fleet.py)."""
    config = config or ServerConfig()
    server = OpenAIServer(service, config)
    routes: list[BaseRoute] = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
    ]
    routes += observability if observability is not None else _observability_routes(service, metrics)
    handlers = {P.ApiError: _error_response, HTTPException: _error_response, Exception: _error_response}
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.server = server
    return app


def _observability_routes(service: EngineService, metrics: ServingMetrics | None) -> list[BaseRoute]:
    """/metrics (Prometheus exposition) and the dashboard, both over one ServingMetrics."""
    metrics = metrics if metrics is not None else ServingMetrics(service)

    async def render(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return [Route("/metrics", render, methods=["GET"]), *dashboard_routes(metrics)]
