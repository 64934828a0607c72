"""The reference inference server: the tiny local model behind vLLM's token-ID completion API.
``rollstream serve-model`` runs it; ``create_app(settings)`` builds the ASGI app for tests.

Routes (request and response shapes follow vLLM's OpenAI server; docs/model-server.md):
    POST /v1/completions        prompt as token ids (or text); ``return_token_ids`` adds
                                ``choices[].token_ids`` and ``choices[].prompt_token_ids``;
                                ``logprobs`` + ``return_tokens_as_token_ids`` ("token_id:N");
                                ``stream: true``: vLLM's chunks, one per sampled token, as SSE
                                (``EventStream``; a client that hangs up aborts its row)
    POST /v1/chat/completions   plain chat: messages rendered with the model's chat template;
                                ``stream: true``: vLLM's chat.completion.chunk events
    GET  /v1/models             model card (max_model_len, policy_version)
    GET  /openapi.json          every route, its bounds and errors (openapi.py)
    GET  /health                200 once the model is loaded, 503 before
    GET  /v1/policy_version     {"policy_version", "weights_path", "loaded_at"}
    GET  /v1/load               {"queued", "running", "paused", "policy_version",
                                 "streams_aborted"}
    POST /v1/load_weights       {"path", "version"}: load a checkpoint between two batches
  and vLLM's dev-mode RL routes (``VLLM_SERVER_DEV_MODE=1``), so one client drives both:
    POST /pause?mode=abort|wait|keep   POST /resume   GET /is_paused
    POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": ...}}
    POST /update_weight_version {"new_version": "N"}   GET /weight_info
  and the probes (docs/metrics.md): GET /metrics (``metrics_key``), /livez, /readyz. Ready:
  the model is loaded, its scheduler runs, and it is not paused (a weight update).

Auth (``Authorization: Bearer KEY``; 401 otherwise): the weight and control routes
(``ADMIN_ROUTES``: /v1/load_weights, /pause, /resume, /collective_rpc, /update_weight_version)
take ``model_admin_key`` only; every other route but ``/health`` and the probes takes
``model_api_key`` (vLLM's ``--api-key``) or the admin key. The proxy is the one caller: it sends
``proxy_backend_admin_key`` to the weight routes and ``proxy_backend_api_key`` to the rest;
harnesses never learn the server's address. With no admin key the weight routes take the model
key (one warning at start); with no model key the other routes are open; with neither the
server is open and warns loudly.

The rooms: settings.py (ModelServerSettings), engine.py (the model's worker thread and the
batching scheduler), wire.py (request checks and response bodies), this module (routes).
Every completion reports the one policy version that produced it in ``policy_version`` (a
rollstream extension). Errors: rollstream.inference.errors (``RequestRefused`` answered with
its status, ``TinyModelError`` with a 400, anything else a 500 with the reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.config import LOGGING_CONFIG

from rollstream.adapters.asgi_stream import send_stream
from rollstream.adapters.auth import bearer_token, key_matches
from rollstream.adapters.metrics import ServiceMetrics, metrics_routes
from rollstream.inference import wire
from rollstream.inference.engine import Engine, Scheduler, TokenStep
from rollstream.inference.errors import RequestRefused, TinyModelError
from rollstream.inference.openapi import OPENAPI
from rollstream.inference.settings import ModelServerSettings
from rollstream.inference.tinymodel import GenerationResult

__all__ = ["ADMIN_ROUTES", "OPEN_ROUTES", "ModelMetrics", "create_app", "route_keys", "run"]


log = logging.getLogger(__name__)


POLICY_VERSION_DIGITS = 16  # 2**53 - 1 has 16: ASCII digits only ("²".isdigit() is True)
_VERSION = re.compile(rf"[0-9]{{1,{POLICY_VERSION_DIGITS}}}\Z")


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(wire.error_body(message, status, param), status_code=status)


async def _json(request: Request, limit: int = 64 * 1024) -> dict[str, Any]:
    try:
        return wire.parse_json(await request.body(), limit)
    except UnicodeDecodeError as exc:  # json.loads reads UTF-16/32 by the first bytes: a 400
        raise RequestRefused(f"invalid JSON: {exc}") from exc


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class EventStream(Response):
    """A server-sent-events answer sent part by part from an async iterator of bytes. While it
    is sent, the client's side is watched: a client that hangs up cancels the iteration at
    once (its ``finally`` runs; for a streamed completion that aborts the request's row).
    Starlette's StreamingResponse under ASGI spec 2.4 only notices a hang-up when a write
    fails, and uvicorn drops writes to a closed connection silently."""

    media_type = "text/event-stream"

    def __init__(self, parts: AsyncIterator[bytes]) -> None:
        self.parts = parts
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send_stream(self.parts, 200, self.raw_headers, receive, send)


class ModelMetrics:
    """The model server's metrics (``rollstream_model_*``) and readiness."""

    def __init__(self, api: _Api) -> None:
        self.service = m = ServiceMetrics("model")
        self.requests = m.counter(
            "requests", "HTTP requests answered, by route and status code", ("route", "code")
        )
        self.seconds = m.histogram("request_seconds", "time to answer a request", ("route",))
        self.generate = m.histogram(
            "generate_seconds", "one completion: queued, batched and generated"
        )
        self.tokens = m.counter("tokens", "prompt and completion tokens", ("kind",))
        self.streams = m.counter(
            "streams", "streamed completions, by outcome: finished or aborted (client gone)",
            ("outcome",),
        )  # fmt: skip
        engine = api.engine

        def sched() -> Scheduler:
            if api.sched is None:
                raise LookupError("the model is not loaded")
            return api.sched

        m.gauge_fn("policy_version", "the policy version loaded", lambda: engine.version)
        m.gauge_fn("queued", "requests waiting for a batch", lambda: len(sched().queue))
        m.gauge_fn("running", "requests in the batch being generated", lambda: sched().in_batch)
        m.gauge_fn("paused", "1 while paused (a weight update)", lambda: sched().paused)

        def loaded() -> tuple[bool, str]:
            ok = api.sched is not None and api.sched.alive()
            return ok, f"version {engine.version}" if ok else "not loaded"

        def serving() -> tuple[bool, str]:
            ok = api.sched is not None and not api.sched.paused
            return ok, "serving" if ok else "paused"

        m.health.watch("model", loaded)
        m.health.watch("serving", serving)

    async def submit(
        self, sched: Scheduler, prompt: list[int], params: Any
    ) -> tuple[GenerationResult, int]:
        """``sched.submit`` timed and its tokens counted."""
        started = time.perf_counter()
        out = await sched.submit(prompt, params)
        self.generate.observe(time.perf_counter() - started)
        self.tokens.labels("prompt").inc(len(prompt))
        self.tokens.labels("completion").inc(len(out[0].token_ids))
        return out


class _Api:
    """The route handlers, over one engine and its scheduler."""

    def __init__(self, settings: ModelServerSettings) -> None:
        self.settings = settings
        self.engine = Engine(settings)
        self.sched: Scheduler | None = None
        self.seeds = random.Random(settings.model_seed)  # seeds of requests sent without one
        self.metrics = ModelMetrics(self)

    def live(self) -> Scheduler:
        if self.sched is None or not self.sched.alive():
            raise RequestRefused("the model is not loaded", status=503)
        return self.sched

    async def completions(self, request: Request) -> Response:
        sched, engine, name = self.live(), self.engine, self.settings.model_name
        sched.arriving += 1
        try:
            body = await _json(request, self.settings.model_max_request_bytes)
            wire.check_model(body, name)
            prompts = wire.prompts(body, engine.tokenizer, engine.vocab)
            longest = max(len(p) for p in prompts)
            params = wire.sampling(body, engine.max_len, longest, self.seeds.getrandbits(63))
        finally:
            sched.arriving -= 1
        if wire.stream_flag(body):
            if len(prompts) != 1:
                raise RequestRefused("`stream` takes one prompt", param="prompt")
            include_usage = wire.stream_options(body)
            steps = sched.stream(prompts[0], params)  # queued now: 503 when full
            head = self._head("cmpl", "text_completion")
            skip = body.get("skip_special_tokens", True) is not False
            tok, prompt = engine.tokenizer, prompts[0]
            return EventStream(
                self._sse_steps(
                    steps,
                    prompt,
                    include_usage,
                    head,
                    wire.IncrementalText(tok, skip_special_tokens=skip),
                    lambda step, piece, n, offset: [
                        wire.completion_chunk(
                            head, body, step, piece, offset, prompt if n == 0 else None, tok
                        )
                    ],
                )
            )
        outs = await asyncio.gather(*(self.metrics.submit(sched, p, params) for p in prompts))
        return JSONResponse(
            wire.completion_body(body, prompts, params, outs, engine.tokenizer, name)
        )

    def _head(self, prefix: str, kind: str) -> dict[str, Any]:
        """The fields every chunk of one streamed answer repeats."""
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.settings.model_name,
        }

    async def _sse_steps(
        self,
        steps: AsyncIterator[TokenStep],
        prompt: list[int],
        include_usage: bool,
        head: dict[str, Any],
        text: wire.IncrementalText,
        chunk: Callable[[TokenStep, str, int, int], list[dict[str, Any]]],
    ) -> AsyncIterator[bytes]:
        """A streamed answer: the events of ``chunk(step, piece, n, offset)`` per sampled token
        (``piece``: the new complete text, ``n``: the tokens before, ``offset``: the text sent
        before), the usage chunk if asked for, ``data: [DONE]``. An error after the first byte
        is a ``data: {"error": ...}`` event, as vLLM sends it."""
        metrics = self.metrics
        n = offset = 0
        started, outcome = time.perf_counter(), "aborted"
        try:
            async for step in steps:
                piece = text.push(step.token_id)
                if step.finish_reason is not None:
                    piece += text.flush()
                events = chunk(step, piece, n, offset)
                offset, n = offset + len(piece), n + 1
                for event in events:
                    yield _sse(event)
            if include_usage:
                yield _sse(wire.usage_chunk(head, len(prompt), n))
            outcome = "finished"
        except RequestRefused as exc:
            outcome = "failed"
            yield _sse(wire.error_body(exc.message, exc.status, exc.param))
        except Exception as exc:  # the batch failed: said in the stream, never a dropped socket
            outcome = "failed"
            yield _sse(wire.error_body(f"{type(exc).__name__}: {exc}", 500))
        finally:
            metrics.streams.labels(outcome).inc()
            metrics.generate.observe(time.perf_counter() - started)
            metrics.tokens.labels("prompt").inc(len(prompt))
            metrics.tokens.labels("completion").inc(n)
        yield b"data: [DONE]\n\n"

    async def chat_completions(self, request: Request) -> Response:
        """Plain chat (vLLM's route, without tools or multiple choices): the messages rendered
        with the model's chat template, one completion, its text as the reply; with ``stream:
        true`` as vLLM streams it (``chat.completion.chunk`` events: the role first, then the
        text as it is generated, the finish reason on the last token's chunk). For harnesses
        and proxies that speak chat to the backend (LiteLLM, a direct baseline); the recording
        proxy sends token ids to /v1/completions instead."""
        sched, engine, name = self.live(), self.engine, self.settings.model_name
        sched.arriving += 1
        try:
            body = await _json(request, self.settings.model_max_request_bytes)
            stream = wire.stream_flag(body)
            include_usage = wire.stream_options(body) if stream else False
            prompt = wire.chat_prompt(body, engine.tokenizer, engine.vocab, name)
            params = wire.sampling(body, engine.max_len, len(prompt), self.seeds.getrandbits(63))
        finally:
            sched.arriving -= 1
        if stream:
            steps = sched.stream(prompt, params)  # queued now: 503 when full
            head = self._head("chatcmpl", "chat.completion.chunk")

            def chunk(step: TokenStep, piece: str, n: int, offset: int) -> list[dict[str, Any]]:
                version = step.policy_version
                out = [wire.chat_chunk(head, "", None, version, role=True)] if n == 0 else []
                if piece or step.finish_reason is not None:  # else: a character split in tokens
                    out.append(wire.chat_chunk(head, piece, step.finish_reason, version))
                return out

            text = wire.IncrementalText(engine.tokenizer)
            return EventStream(self._sse_steps(steps, prompt, include_usage, head, text, chunk))
        result, version = await self.metrics.submit(sched, prompt, params)
        return JSONResponse(wire.chat_body(prompt, result, version, engine.tokenizer, name))

    async def models(self, request: Request) -> Response:
        self.live()
        e = self.engine
        card = {
            "id": self.settings.model_name,
            "object": "model",
            "created": int(e.loaded_at),
            "owned_by": "rollstream",
            "root": str(e.path),
            "parent": None,
            "max_model_len": e.max_len,
            "policy_version": e.version,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        self.live()
        return Response(status_code=200)

    async def policy_version(self, request: Request) -> Response:
        self.live()
        e = self.engine
        return JSONResponse(
            {"policy_version": e.version, "weights_path": e.weights_path, "loaded_at": e.loaded_at}
        )

    async def load(self, request: Request) -> Response:
        s = self.live()
        return JSONResponse(
            {
                "queued": len(s.queue),
                "running": s.in_batch,
                "paused": s.paused,
                "policy_version": self.engine.version,
                "streams_aborted": s.streams_aborted,
            }
        )

    async def _reload(self, path: Any, version: int | None) -> int:
        if not isinstance(path, str) or not path:
            raise RequestRefused("`path` must be a non-empty string", param="path")
        try:
            return await self.live().call(self.engine.load_weights, path, version)
        except TinyModelError as exc:
            raise RequestRefused(str(exc), param="path") from exc

    async def load_weights(self, request: Request) -> Response:
        self.live()
        body, current = await _json(request), self.engine.version
        version: int = wire.number(body, "version", current + 1, lo=0)
        if version < current:
            msg = f"version {version} is older than the current {current}"
            raise RequestRefused(msg, status=409, param="version")
        started = time.perf_counter()
        version = await self._reload(body.get("path"), version)
        load_s = round(time.perf_counter() - started, 4)
        return JSONResponse({"policy_version": version, "path": body["path"], "load_s": load_s})

    # vLLM's dev-mode RL routes (vllm/entrypoints/serve/dev/rlhf/api_router.py) ------------

    async def pause(self, request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            raise RequestRefused("mode must be one of abort, wait, keep", param="mode")
        await self.live().pause(mode)
        return JSONResponse({"status": "paused"})

    async def resume(self, request: Request) -> Response:
        self.live().resume()
        return JSONResponse({"status": "resumed"})

    async def is_paused(self, request: Request) -> Response:
        return JSONResponse({"is_paused": self.live().paused})

    async def collective_rpc(self, request: Request) -> Response:
        body = await _json(request)
        if body.get("method") != "reload_weights":
            raise RequestRefused("only method 'reload_weights' is supported", param="method")
        kwargs = body.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RequestRefused("`kwargs` must be an object", param="kwargs")
        await self._reload(kwargs.get("weights_path"), None)
        return JSONResponse({"results": [None]})

    async def update_weight_version(self, request: Request) -> Response:
        self.live()
        new = (await _json(request)).get("new_version")
        if isinstance(new, bool) or not isinstance(new, str | int) or not _VERSION.match(str(new)):
            msg = f"`new_version` must be an integer of at most {POLICY_VERSION_DIGITS} digits"
            raise RequestRefused(msg, "new_version")
        self.engine.version = int(new)
        return JSONResponse({"success": True, "new_version": str(new)})

    async def weight_info(self, request: Request) -> Response:
        self.live()
        return JSONResponse({"weight_version": str(self.engine.version)})


OPEN_ROUTES: frozenset[str] = frozenset({"/health"})  # answered without a key
_REFUSAL = "a valid API key is required (Authorization: Bearer KEY)"
_ADMIN_REFUSAL = "the model server's admin key is required (Authorization: Bearer KEY)"
# the weight and control routes: the admin key's only (the model key's while none is set)
ADMIN_ROUTES: frozenset[str] = frozenset(
    {"/v1/load_weights", "/pause", "/resume", "/collective_rpc", "/update_weight_version"}
)


def route_keys(route: str, model: bytes | None, admin: bytes | None) -> tuple[bytes, ...] | None:
    """The keys that open ``route`` (None: it is open). Pure."""
    if route in OPEN_ROUTES:
        return None
    if route in ADMIN_ROUTES:
        key = admin if admin is not None else model
        return None if key is None else (key,)
    if model is None:
        return None
    return (model,) if admin is None else (model, admin)


def _guard(
    handler: Callable[[Request], Awaitable[Response]],
    route: str,
    metrics: ModelMetrics,
    keys: tuple[bytes, ...] | None = None,
    refusal: str = _REFUSAL,
) -> Callable[[Request], Any]:
    async def answer(request: Request) -> Response:
        token = bearer_token(request.headers.get("authorization"))
        if keys is not None and not key_matches(token, keys):
            return _error(refusal, 401)
        try:
            return await handler(request)
        except RequestRefused as exc:
            return _error(exc.message, exc.status, exc.param)
        except TinyModelError as exc:
            return _error(str(exc), 400)
        except Exception as exc:  # answered as a 500 with the reason, never a dropped socket
            return _error(f"{type(exc).__name__}: {exc}", 500)

    async def wrapped(request: Request) -> Response:
        started = time.perf_counter()
        response = await answer(request)
        metrics.requests.labels(route, str(response.status_code)).inc()
        metrics.seconds.labels(route).observe(time.perf_counter() - started)
        return response

    return wrapped


def _key(secret: SecretStr | None) -> bytes | None:
    return secret.get_secret_value().encode() if secret and secret.get_secret_value() else None


def _warn_keys(settings: ModelServerSettings, model: bytes | None, admin: bytes | None) -> None:
    """The warning at start about the keys left unset (none when both are set)."""
    where = f"{settings.model_host}:{settings.model_port}"
    if model is None and admin is None:
        log.warning(
            "!!! no model_api_key set: the model server on %s generates and loads weights "
            "for anyone who can reach it (set ROLLSTREAM_MODEL_API_KEY and "
            "ROLLSTREAM_MODEL_ADMIN_KEY) !!!",
            where,
        )
    elif admin is None:
        log.warning(
            "no model_admin_key set: the model server on %s loads weights, pauses and resumes "
            "for the model key too (set ROLLSTREAM_MODEL_ADMIN_KEY, and the proxy's "
            "ROLLSTREAM_PROXY_BACKEND_ADMIN_KEY to the same)",
            where,
        )
    elif model is None:
        log.warning(
            "no model_api_key set: the model server on %s generates for anyone who can reach "
            "it; its weight routes take the admin key (set ROLLSTREAM_MODEL_API_KEY)",
            where,
        )


def create_app(settings: ModelServerSettings) -> Starlette:
    """Build the server app. The model loads at lifespan startup, in the worker thread."""
    api = _Api(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sched = Scheduler(api.engine, settings)
        try:
            await sched.call(api.engine.load)
            sched.start()
            api.sched = sched
            yield
        finally:
            sched.close()

    get, post = ["GET"], ["POST"]
    model, admin = _key(settings.model_api_key), _key(settings.model_admin_key)
    _warn_keys(settings, model, admin)
    routes = []
    for path, handler, methods in [
        ("/v1/completions", api.completions, post),
        ("/v1/chat/completions", api.chat_completions, post),
        ("/v1/models", api.models, get),
        ("/health", api.health, get),
        ("/v1/policy_version", api.policy_version, get),
        ("/v1/load", api.load, get),
        ("/v1/load_weights", api.load_weights, post),
        ("/pause", api.pause, post),
        ("/resume", api.resume, post),
        ("/is_paused", api.is_paused, get),
        ("/collective_rpc", api.collective_rpc, post),
        ("/update_weight_version", api.update_weight_version, post),
        ("/weight_info", api.weight_info, get),
    ]:
        keys = route_keys(path, model, admin)
        refusal = _ADMIN_REFUSAL if path in ADMIN_ROUTES and admin is not None else _REFUSAL
        guard = _guard(handler, path, api.metrics, keys, refusal)
        routes.append(Route(path, guard, methods=methods))
    routes.append(Route("/openapi.json", lambda _: JSONResponse(OPENAPI), methods=get))
    routes += metrics_routes(api.metrics.service, settings.metrics_key)
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.metrics = api.metrics
    return app


def run(settings: ModelServerSettings) -> None:
    """Serve until interrupted (``rollstream serve-model``)."""
    uvicorn.run(
        create_app(settings),
        host=settings.model_host,
        port=settings.model_port,
        log_level=settings.model_log_level,
        log_config=None if settings.log_format == "json" else LOGGING_CONFIG,  # json: root's
    )
