"""The reference inference server: the tiny local model behind vLLM's token-ID completion API.

Routes (request and response shapes follow vLLM's OpenAI server; docs/model-server.md):
    POST /v1/completions        prompt as token ids (or text); ``return_token_ids`` adds
                                ``choices[].token_ids`` and ``choices[].prompt_token_ids``;
                                ``logprobs`` + ``return_tokens_as_token_ids`` ("token_id:N")
    GET  /v1/models             model card (max_model_len, policy_version)
    GET  /health                200 once the model is loaded, 503 before
    GET  /v1/policy_version     {"policy_version", "weights_path", "loaded_at"}
    GET  /v1/load               {"queued", "running", "paused", "policy_version"}
    POST /v1/load_weights       {"path", "version"}: load a checkpoint between two batches
  and vLLM's dev-mode RL routes (``VLLM_SERVER_DEV_MODE=1``), so one client drives both:
    POST /pause?mode=abort|wait|keep   POST /resume   GET /is_paused
    POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": ...}}
    POST /update_weight_version {"new_version": "N"}   GET /weight_info

Concurrency: one worker thread owns the model, so the event loop (and /health) stays free.
Requests queue up; the scheduler takes up to ``model_max_batch`` of them (after waiting
``model_batch_wait_ms`` for company) and runs them as one batch in that thread. Weight loads
run in the same thread between batches, so every completion comes from exactly one policy
version, which the response reports in its ``policy_version`` field (a rollstream extension).

Errors::

    ModelServerError            root of rollstream.inference.server
    └── RequestRefused          a request we refuse; carries the HTTP status (4xx, or 503)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollstream.inference.tinymodel import (
    GenerationResult,
    LogprobsMode,
    SamplingParams,
    TinyModelError,
    apply_state_dict,
    ensure_tiny_model,
    generate,
    load_model,
    load_state_dict,
    stop_token_ids,
)
from rollstream.schemas.settings import CommonSettings

__all__ = ["ModelServerError", "ModelServerSettings", "RequestRefused", "create_app", "run"]

T = TypeVar("T")
MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs


class ModelServerSettings(CommonSettings):
    """Settings of the reference inference server (ROLLSTREAM_MODEL_*)."""

    model_path: Path | None = None  # default: <home>/models/tiny
    model_name: str = "rollstream-tiny"
    model_host: str = "127.0.0.1"
    model_port: int = 8100
    model_seed: int = 0  # seeds the tiny model when created, and requests sent without a seed
    model_create: bool = True  # create the tiny model at model_path when none is there
    model_max_batch: int = 16
    model_batch_wait_ms: float = 2.0
    model_max_len: int | None = None  # default: the model's max_position_embeddings
    model_max_queue: int = 4096
    model_max_request_bytes: int = 8 * 1024 * 1024
    model_logprobs_mode: LogprobsMode = "processed_logprobs"
    model_device: str = "cpu"
    model_torch_threads: int | None = 1  # None: torch default (all cores); 1 is robust on CPU
    model_log_level: str = "warning"

    def resolved_model_path(self) -> Path:
        return self.model_path if self.model_path is not None else self.home / "models" / "tiny"


class ModelServerError(Exception):
    """Root of every error raised by rollstream.inference.server."""


class RequestRefused(ModelServerError):
    """A request the server refuses, answered with ``status`` and an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    kind = {404: "NotFoundError", 409: "ConflictError", 413: "RequestTooLargeError"}.get(
        status, "InternalServerError" if status >= 500 else "BadRequestError"
    )  # vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


# --------------------------------------------------------------------------- engine + scheduler


class _Engine:
    """The model, its tokenizer and the policy version. Used only from the worker thread,
    except for read-only attributes (tokenizer, vocab, version)."""

    def __init__(self, settings: ModelServerSettings) -> None:
        self.settings = settings
        self.path = settings.resolved_model_path()
        self.version = 0
        self.weights_path = str(self.path)
        self.loaded_at = 0.0

    def load(self) -> None:
        s = self.settings
        if s.model_torch_threads:
            torch.set_num_threads(s.model_torch_threads)
        if s.model_create:
            ensure_tiny_model(self.path, seed=s.model_seed)
        self.model, self.tokenizer = load_model(self.path, device=s.model_device)
        self.vocab = int(self.model.config.vocab_size)
        self.max_len = s.model_max_len or int(self.model.config.max_position_embeddings)
        self.eos = stop_token_ids(self.tokenizer)
        self.loaded_at = time.time()

    def run(
        self, prompts: list[list[int]], params: list[SamplingParams], abort: Callable[[], bool]
    ) -> tuple[list[GenerationResult], int]:
        version = self.version  # /update_weight_version may change it during the batch
        results = generate(
            self.model, prompts, params, eos_token_ids=self.eos,
            pad_token_id=self.tokenizer.pad_token_id or 0,
            logprobs_mode=self.settings.model_logprobs_mode, should_abort=abort,
        )  # fmt: skip
        return results, version

    def load_weights(self, path: str, version: int | None) -> int:
        apply_state_dict(self.model, load_state_dict(path))
        self.weights_path, self.loaded_at = path, time.time()
        if version is not None:
            self.version = version
        return self.version


@dataclass(slots=True)
class _Pending:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future[tuple[GenerationResult, int]]


class _Scheduler:
    """Queues requests and runs them in batches in the single worker thread."""

    def __init__(self, engine: _Engine, settings: ModelServerSettings) -> None:
        self.engine = engine
        self.max_batch = max(1, settings.model_max_batch)
        self.wait_s = max(0.0, settings.model_batch_wait_ms / 1000)
        self.max_queue = settings.model_max_queue
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.queue: deque[_Pending] = deque()
        self.wake = asyncio.Event()
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.abort = threading.Event()
        self.running: asyncio.Future[Any] | None = None
        self.task: asyncio.Task[None] | None = None
        self.arriving = 0  # requests received but not yet queued (body being read or parsed)
        self.in_batch = 0  # requests in the batch being generated

    @property
    def paused(self) -> bool:
        return not self.unpaused.is_set()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` in the worker thread, after the batch in progress (never during it)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def submit(
        self, prompt: list[int], params: SamplingParams
    ) -> tuple[GenerationResult, int]:
        if len(self.queue) >= self.max_queue:
            raise RequestRefused("server queue is full", status=503)
        pending = _Pending(prompt, params, asyncio.get_running_loop().create_future())
        self.queue.append(pending)
        self.wake.set()
        return await pending.future

    async def pause(self, mode: str) -> None:
        self.unpaused.clear()
        if mode == "abort":
            self.abort.set()
        try:
            if self.running is not None:
                await asyncio.shield(self.running)
        except Exception:  # the batch's own requests get the error
            pass
        finally:
            self.abort.clear()

    def resume(self) -> None:
        self.unpaused.set()
        self.wake.set()

    async def loop(self) -> None:
        while True:
            await self.wake.wait()
            await self.unpaused.wait()
            if self.wait_s and len(self.queue) < self.max_batch:  # wait a little for company
                await asyncio.sleep(self.wait_s)
                deadline = time.monotonic() + 10 * self.wait_s
                while self.arriving and len(self.queue) < self.max_batch:
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(self.wait_s / 4)
            if self.paused:
                continue
            batch: list[_Pending] = []
            while self.queue and len(batch) < self.max_batch:
                p = self.queue.popleft()
                if not p.future.done():  # a cancelled request is skipped
                    batch.append(p)
            if not self.queue:
                self.wake.clear()
            if batch:
                await self._run(batch)

    async def _run(self, batch: list[_Pending]) -> None:
        prompts, params = [p.prompt for p in batch], [p.params for p in batch]
        self.in_batch = len(batch)
        loop = asyncio.get_running_loop()
        self.running = loop.run_in_executor(
            self.executor, self.engine.run, prompts, params, self.abort.is_set
        )
        try:
            results, version = await self.running
        except Exception as exc:
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
        else:
            for p, r in zip(batch, results, strict=True):
                if not p.future.done():
                    p.future.set_result((r, version))
        finally:
            self.running, self.in_batch = None, 0

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        while self.queue:
            p = self.queue.popleft()
            if not p.future.done():
                p.future.set_exception(RequestRefused("server is shutting down", status=503))
        self.executor.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- request parsing


def _num(
    body: dict[str, Any], key: str, default: Any, kind: type = int, lo: float | None = None
) -> Any:
    """``body[key]`` as an int (or a float with ``kind=float``), ``default`` when absent."""
    value = body.get(key)
    if value is None:
        return default
    ok = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        raise RequestRefused(
            f"`{key}` must be {'an integer' if kind is int else 'a number'}", param=key
        )
    if lo is not None and value < lo:
        raise RequestRefused(f"`{key}` must be >= {lo}", param=key)
    return kind(value)


def _prompts(body: dict[str, Any], engine: _Engine) -> list[list[int]]:
    """A prompt is a list of token ids or a string; a list of either is a batch of prompts."""
    raw = body.get("prompt")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise RequestRefused("`prompt` must be token ids, a string, or a list of them", "prompt")
    prompts: list[list[int]] = []
    for item in raw:
        if isinstance(item, str):
            ids = engine.tokenizer.encode(item, add_special_tokens=True)
        elif isinstance(item, list) and all(type(t) is int for t in item):
            ids = item
        else:
            raise RequestRefused("`prompt` must hold token ids or strings", param="prompt")
        prompts.append(_checked_ids(ids, engine, "prompt"))
    return prompts


def _checked_ids(ids: list[int], engine: _Engine, param: str) -> list[int]:
    if not ids:
        raise RequestRefused("empty prompt", param=param)
    if min(ids) < 0 or max(ids) >= engine.vocab:
        raise RequestRefused(f"token id out of range [0, {engine.vocab})", param=param)
    return ids


def _check_model(body: dict[str, Any], model_name: str) -> None:
    if body.get("model") not in (None, model_name):
        msg = f"The model `{body['model']}` does not exist."
        raise RequestRefused(msg, status=404, param="model")


def _chat_prompt(body: dict[str, Any], engine: _Engine, model_name: str) -> list[int]:
    """The token ids of a chat request's messages, rendered with the model's template."""
    _check_model(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestRefused("`messages` must be a non-empty list", param="messages")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):  # fmt: skip
            raise RequestRefused(
                "each message needs a string `role` and a string `content`", param="messages"
            )
    if body.get("tools"):
        raise RequestRefused("`tools` is not supported by the reference server's chat route",
                             param="tools")  # fmt: skip
    tok = engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = [int(t) for t in tok.encode(text, add_special_tokens=False)]
    return _checked_ids(prompt, engine, "messages")


def _sampling(body: dict[str, Any], max_len: int, longest: int, seed: int) -> SamplingParams:
    if (n := _num(body, "n", 1)) != 1:
        raise RequestRefused(f"only n=1 is supported, got {n}", param="n")
    for flag in ("stream", "echo", "use_beam_search"):
        if body.get(flag):
            raise RequestRefused(f"`{flag}` is not supported by the reference server", flag)
    max_tokens: int = _num(body, "max_tokens", 16, lo=1)
    temperature = _num(body, "temperature", 1.0, float, lo=0)
    top_p = _num(body, "top_p", 1.0, float)
    if not 0 < top_p <= 1:
        raise RequestRefused("`top_p` must be in (0, 1]", param="top_p")
    top = _num(body, "logprobs", 0, lo=0)
    if top > MAX_TOP_LOGPROBS:
        raise RequestRefused(f"`logprobs` must be <= {MAX_TOP_LOGPROBS}", param="logprobs")
    stops = body.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(type(t) is int for t in stops):
        raise RequestRefused("`stop_token_ids` must be a list of token ids", "stop_token_ids")
    if longest + max_tokens > max_len:
        raise RequestRefused(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
            "completion).",
            param="max_tokens",
        )
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        seed=_num(body, "seed", seed), stop_token_ids=tuple(stops),
        ignore_eos=bool(body.get("ignore_eos", False)), top_logprobs=top,
    )  # fmt: skip


def _logprobs_body(
    r: GenerationResult, token_str: Callable[[int], str], want_top: bool
) -> dict[str, Any]:
    """vLLM's CompletionLogProbs: each step's top_logprobs holds the top-k and the sampled."""
    tokens = [token_str(t) for t in r.token_ids]
    offsets = [sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
    top = [
        {**({token_str(a): v for a, v in r.top_logprobs[i]} if want_top else {}), tokens[i]: lp}
        for i, lp in enumerate(r.logprobs)
    ]
    return {"text_offset": offsets, "token_logprobs": r.logprobs, "tokens": tokens,
            "top_logprobs": top}  # fmt: skip


async def _json(request: Request, limit: int = 64 * 1024) -> dict[str, Any]:
    body = await request.body()
    if len(body) > limit:
        raise RequestRefused(f"request body over {limit} bytes", status=413)
    try:
        data = json.loads(body or b"{}")
    except json.JSONDecodeError as exc:
        raise RequestRefused(f"invalid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise RequestRefused("the request body must be a JSON object")
    return data


# --------------------------------------------------------------------------- the app


class _Api:
    """The route handlers, over one engine and its scheduler."""

    def __init__(self, settings: ModelServerSettings) -> None:
        self.settings = settings
        self.engine = _Engine(settings)
        self.sched: _Scheduler | None = None
        self.seeds = random.Random(settings.model_seed)  # seeds of requests sent without one

    def live(self) -> _Scheduler:
        if self.sched is None or self.sched.task is None or self.sched.task.done():
            raise RequestRefused("the model is not loaded", status=503)
        return self.sched

    async def completions(self, request: Request) -> Response:
        sched = self.live()
        sched.arriving += 1
        try:
            prompts, params, body = await self._parse(request)
        finally:
            sched.arriving -= 1
        outs = await asyncio.gather(*(sched.submit(p, params) for p in prompts))
        return self._completion_response(body, prompts, params, outs)

    async def _parse(
        self, request: Request
    ) -> tuple[list[list[int]], SamplingParams, dict[str, Any]]:
        engine = self.engine
        body = await _json(request, self.settings.model_max_request_bytes)
        _check_model(body, self.settings.model_name)
        prompts = _prompts(body, engine)
        longest = max(len(p) for p in prompts)
        params = _sampling(body, engine.max_len, longest, self.seeds.getrandbits(63))
        return prompts, params, body

    def _completion_response(
        self,
        body: dict[str, Any],
        prompts: list[list[int]],
        params: SamplingParams,
        outs: list[tuple[GenerationResult, int]],
    ) -> Response:
        as_ids, want_ids = body.get("return_tokens_as_token_ids"), body.get("return_token_ids")
        skip_special = body.get("skip_special_tokens", True) is not False
        tok = self.engine.tokenizer

        def token_str(t: int) -> str:
            return f"token_id:{t}" if as_ids else str(tok.decode([t]))

        choices = [{
            "index": i,
            "text": str(tok.decode(r.token_ids, skip_special_tokens=skip_special)),
            "logprobs": _logprobs_body(r, token_str, params.top_logprobs > 0)
            if body.get("logprobs") is not None else None,
            "finish_reason": r.finish_reason,
            "stop_reason": r.stop_reason,
            "token_ids": r.token_ids if want_ids else None,
            "prompt_token_ids": prompt if want_ids else None,
        } for i, (prompt, (r, _)) in enumerate(zip(prompts, outs, strict=True))]  # fmt: skip
        n_in, n_out = sum(map(len, prompts)), sum(len(r.token_ids) for r, _ in outs)
        return JSONResponse({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": self.settings.model_name, "choices": choices,
            "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                      "total_tokens": n_in + n_out},
            "policy_version": min(v for _, v in outs),
        })  # fmt: skip

    async def chat_completions(self, request: Request) -> Response:
        """Plain chat (vLLM's route, without streaming, tools or multiple choices): the messages
        rendered with the model's chat template, one completion, its text as the reply. For
        harnesses and proxies that speak chat to the backend (LiteLLM, a direct baseline); the
        recording proxy sends token ids to /v1/completions instead."""
        sched = self.live()
        sched.arriving += 1
        try:
            body = await _json(request, self.settings.model_max_request_bytes)
            prompt = _chat_prompt(body, self.engine, self.settings.model_name)
            params = _sampling(body, self.engine.max_len, len(prompt), self.seeds.getrandbits(63))
        finally:
            sched.arriving -= 1
        result, version = await sched.submit(prompt, params)
        text = str(self.engine.tokenizer.decode(result.token_ids, skip_special_tokens=True))
        n_out = len(result.token_ids)
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": self.settings.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": result.finish_reason}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out,
                      "total_tokens": len(prompt) + n_out},
            "policy_version": version,
        })  # fmt: skip

    async def models(self, request: Request) -> Response:
        self.live()
        e = self.engine
        card = {
            "id": self.settings.model_name, "object": "model", "created": int(e.loaded_at),
            "owned_by": "rollstream", "root": str(e.path), "parent": None,
            "max_model_len": e.max_len, "policy_version": e.version,
        }  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        self.live()
        return Response(status_code=200)

    async def policy_version(self, request: Request) -> Response:
        self.live()
        e = self.engine
        return JSONResponse({"policy_version": e.version, "weights_path": e.weights_path,
                             "loaded_at": e.loaded_at})  # fmt: skip

    async def load(self, request: Request) -> Response:
        s = self.live()
        return JSONResponse({"queued": len(s.queue), "running": s.in_batch, "paused": s.paused,
                             "policy_version": self.engine.version})  # fmt: skip

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
        version: int = _num(body, "version", current + 1, lo=0)
        if version < current:
            msg = f"version {version} is older than the current {current}"
            raise RequestRefused(msg, status=409, param="version")
        started = time.perf_counter()
        version = await self._reload(body.get("path"), version)
        return JSONResponse({"policy_version": version, "path": body["path"],
                             "load_s": round(time.perf_counter() - started, 4)})  # fmt: skip

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
        await self._reload((body.get("kwargs") or {}).get("weights_path"), None)
        return JSONResponse({"results": [None]})

    async def update_weight_version(self, request: Request) -> Response:
        self.live()
        new = (await _json(request)).get("new_version")
        if not isinstance(new, str | int) or not str(new).isdigit():
            raise RequestRefused("`new_version` must be an integer string", "new_version")
        self.engine.version = int(new)
        return JSONResponse({"success": True, "new_version": str(new)})

    async def weight_info(self, request: Request) -> Response:
        self.live()
        return JSONResponse({"weight_version": str(self.engine.version)})


def _guard(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Any]:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except RequestRefused as exc:
            return _error(exc.message, exc.status, exc.param)
        except TinyModelError as exc:
            return _error(str(exc), 400)
        except Exception as exc:  # answered as a 500 with the reason, never a dropped socket
            return _error(f"{type(exc).__name__}: {exc}", 500)

    return wrapped


def create_app(settings: ModelServerSettings) -> Starlette:
    """Build the server app. The model loads at lifespan startup, in the worker thread."""
    api = _Api(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sched = _Scheduler(api.engine, settings)
        try:
            await sched.call(api.engine.load)
            sched.task = asyncio.create_task(sched.loop(), name="model-scheduler")
            api.sched = sched
            yield
        finally:
            sched.close()

    get, post = ["GET"], ["POST"]
    routes = [
        Route(path, _guard(handler), methods=methods)
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
        ]
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def run(settings: ModelServerSettings) -> None:
    """Serve until interrupted (the ``rollstream`` CLI calls this)."""
    uvicorn.run(
        create_app(settings), host=settings.model_host, port=settings.model_port,
        log_level=settings.model_log_level,
    )  # fmt: skip


if __name__ == "__main__":
    run(ModelServerSettings())
