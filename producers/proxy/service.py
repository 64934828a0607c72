"""The recording OpenAI-compatible proxy: a harness changes only its base_url and every model call
becomes an LlmCall event with the token IDs that were actually sampled.

    harness --(OpenAI HTTP, base_url=/rollouts/{id}/v1)--> proxy --(token ids)--> backend pool
                                                             `--> Recorder (SDK) --> Kafka

Routes (docs/proxy.md; GET /openapi.json describes them):
    POST /rollouts/{rollout_id}/v1/chat/completions   stream or not, tools / tool_calls
    POST /rollouts/{rollout_id}/v1/completions        prompt as text or token ids
    GET  /rollouts/{rollout_id}/v1/models
    POST /v1/chat/completions, /v1/completions        the same; the rollout is the token's
    GET  /v1/models, /health, /openapi.json
    the rollout API (rollout_api.py) and the admin routes /v1/admin/{pause,drain,resume,
    update_weights,status}

A chat call: check the rollout token -> read the JSON body (413 past the limit) -> validate ->
render the messages into token ids with the model's chat template, splicing in the ids each
earlier reply was generated with (chat.py; drift counted) -> check the token budget (413) ->
ask the pool (sticky backend, failover; 429 while paused) -> decode the reply, parse tool calls
-> record the LlmCall through the rollout's RolloutHandle (its context trie turns the full
prompt into parent_call_id + prefix_len + prompt_delta) -> answer. Tool messages that answer a
tool call the proxy returned are recorded as ToolCall events. A call that fails after it was
accepted is recorded as a RolloutError event and answered 502/503.

Hot path: the model-call routes (the four POST URLs above) are served as raw ASGI by
``ProxyApp`` (no Starlette routing, middleware, Request or Response per call); the rest goes
through Starlette. Both give the same answers and errors (docs/proxy.md, Performance).

Streaming: the backend call is not streamed (failover needs the whole completion before a byte
goes out), so ``stream=true`` answers with the complete SSE sequence once the completion is
there: a role chunk, a content chunk, a tool_calls chunk, the finish chunk, an optional usage
chunk, ``data: [DONE]``.

Errors: ApiError (rollout_api.py) becomes ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import uvicorn
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import NoDecode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rollstream.producers.proxy.app import ProxyApp
from rollstream.producers.proxy.backends import BackendError, BackendRejected, Completion
from rollstream.producers.proxy.chat import (
    ChatError,
    ChatInputError,
    ChatTemplate,
    normalize_messages,
    normalize_tools,
    parse_reply,
    render_prompt,
    tool_results,
)
from rollstream.producers.proxy.openai_wire import (
    FINISH_REASONS,
    OPENAPI,
    ApiError,
    CallParams,
    ProxyError,
    chat_chunks,
    dumps,
    error_response,
    flag,
    json_response,
    number,
    parse_call,
    read_json,
    sse_body,
    text_chunks,
    usage,
)
from rollstream.producers.proxy.policy_watch import PolicyWatcher
from rollstream.producers.proxy.pool import BackendPool, NoBackendAvailable, PoolError, PoolPaused
from rollstream.producers.proxy.rollout_api import (
    Auth,
    OpenRollout,
    RolloutApi,
    Rollouts,
    RolloutTokens,
)
from rollstream.producers.sdk.ids import new_ulid
from rollstream.producers.sdk.recorder import Recorder, RecorderSettings, RecorderUsageError

__all__ = [
    "ApiError", "Proxy", "ProxyApp", "ProxyError", "ProxySettings", "create_app", "new_ulid", "run",
]  # fmt: skip

log = logging.getLogger("rollstream.producers.proxy.service")


def _split_list(value: Any) -> Any:
    """``a,b`` or a JSON list (environment) or a list (code) -> list."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            import json

            return json.loads(text)
        return [v.strip() for v in text.split(",") if v.strip()]
    return value


class ProxySettings(RecorderSettings):
    """Settings of the recording proxy (ROLLSTREAM_PROXY_*; the recorder's ROLLSTREAM_* too).
    List settings accept a JSON list or a comma-separated string."""

    producer: str = Field(default_factory=lambda: f"proxy@{socket.gethostname()}")
    spool_dir: Path | None = Path(".rollstream/spool-proxy")
    proxy_host: str = "127.0.0.1"
    proxy_port: int = 8200
    proxy_backends: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["http://127.0.0.1:8100"]
    )
    proxy_backend_kind: Literal["reference", "vllm"] = "reference"
    proxy_backend_model: str | None = None  # the model name sent to the backends
    proxy_backend_api_key: SecretStr | None = None
    proxy_backend_timeout_s: float = 300.0
    proxy_model_path: Path | None = None  # tokenizer + chat template; default <home>/models/tiny
    proxy_model_name: str = "rollstream-tiny"  # the id /v1/models shows
    proxy_max_model_len: int | None = None  # default: the model's max_position_embeddings
    proxy_max_prompt_tokens: int | None = None  # default: max_model_len
    proxy_default_max_tokens: int = 1024  # chat calls without max_tokens (capped by the room)
    proxy_max_body_bytes: int = 8 * 1024 * 1024
    proxy_api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    proxy_token_secret: SecretStr | None = None  # HMAC key of rollout tokens; None: random
    proxy_public_url: str | None = None  # base of the base_url handed out; default: request's
    proxy_pause_wait_s: float = 60.0  # a paused call waits this long, then gets 429
    proxy_retry_after_s: float = 2.0
    proxy_backend_wait_s: float = 30.0  # how long a call waits for a healthy backend
    proxy_health_interval_s: float = 2.0
    proxy_rollout_idle_s: float = 3600.0  # rollouts idle this long are finished (timeout)
    proxy_log_level: str = "warning"
    proxy_follow_policy: bool = False  # consume policy.versions: pause, drain, reload, resume

    _lists = field_validator("proxy_backends", "proxy_api_keys", mode="before")(_split_list)

    def resolved_model_path(self) -> Path:
        return self.proxy_model_path or self.home / "models" / "tiny"


class Proxy:
    """The proxy's state and handlers. ``create_app`` wraps one in a Starlette app; the rollout
    service and the trainer may also use it from Python (``create_rollout``, ``pool``)."""

    def __init__(
        self,
        settings: ProxySettings,
        *,
        recorder: Recorder,
        pool: BackendPool,
        chat: ChatTemplate,
    ) -> None:
        self.settings, self.recorder, self.pool, self.chat = settings, recorder, pool, chat
        s = settings
        secret = s.proxy_token_secret.get_secret_value().encode() if s.proxy_token_secret else None
        self.auth = Auth(
            RolloutTokens(secret or secrets.token_bytes(32)),
            [k.get_secret_value() for k in s.proxy_api_keys],
        )
        self.rollouts = Rollouts(recorder, pool)
        self.api = RolloutApi(
            self.rollouts, self.auth, public_url=s.proxy_public_url, max_body=s.proxy_max_body_bytes
        )
        self.max_model_len = s.proxy_max_model_len or chat.max_model_len
        self.max_prompt = s.proxy_max_prompt_tokens or self.max_model_len
        self.model = s.proxy_model_name
        self._sweeper: asyncio.Task[None] | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self.auth.admin_open:
            log.warning("no proxy_api_keys set: the admin and rollout-creation routes are open")
        await self.pool.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="proxy-sweeper")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        self.rollouts.close("the proxy shut down")

    async def _sweep(self) -> None:
        idle = self.settings.proxy_rollout_idle_s
        while True:
            await asyncio.sleep(max(1.0, min(60.0, idle / 4)))
            if n := self.rollouts.sweep(idle):
                log.info("finished %d idle rollouts (timeout)", n)

    # --- Python API --------------------------------------------------------------------------

    def create_rollout(
        self, *, task_id: str, group_id: str, base_url: str, **kw: Any
    ) -> dict[str, Any]:
        """Open a rollout (RolloutStarted) and return {rollout_id, base_url, token}."""
        ro = self.rollouts.create(task_id=task_id, group_id=group_id, **kw)
        rid = ro.rollout_id
        return {"rollout_id": rid, "base_url": f"{base_url.rstrip('/')}/rollouts/{rid}/v1",
                "token": self.auth.tokens.issue(rid)}  # fmt: skip

    # --- model calls -------------------------------------------------------------------------

    def _open(self, request: Request) -> OpenRollout:
        rid = self.auth.rollout(request, request.path_params.get("rollout_id"))
        return self.rollouts.get(rid)

    def _budget(self, prompt_len: int, requested: int | None, default: int) -> int:
        if self.max_prompt and prompt_len > self.max_prompt:
            msg = f"the prompt has {prompt_len} tokens; the limit is {self.max_prompt}"
            raise ApiError(413, msg, param="messages", code="too_many_tokens")
        room = self.max_model_len - prompt_len if self.max_model_len else None
        if requested is None:
            budget = default if room is None else min(default, room)
            if budget < 1:
                msg = f"the prompt ({prompt_len} tokens) fills the context ({self.max_model_len})"
                raise ApiError(413, msg, param="messages", code="too_many_tokens")
            return budget
        if room is not None and requested > room:
            msg = (f"{prompt_len} prompt tokens + max_tokens {requested} exceed the model's "
                   f"context of {self.max_model_len} tokens")  # fmt: skip
            raise ApiError(413, msg, param="max_tokens", code="too_many_tokens")
        return requested

    async def _generate(self, ro: OpenRollout, call_id: str, prompt: np.ndarray, call: CallParams,
                        max_tokens: int) -> Completion:  # fmt: skip
        try:
            return await self.pool.complete(
                ro.rollout_id, prompt, max_tokens=max_tokens, **call.sampling
            )
        except PoolPaused as exc:
            retry = str(math.ceil(exc.retry_after_s))
            raise ApiError(429, str(exc), code="paused", headers={"Retry-After": retry}) from exc
        except NoBackendAvailable as exc:
            backend = exc.last_error.backend if exc.last_error else ""
            self._failed(ro, call_id, str(exc), 503, backend)
            retry = str(math.ceil(self.settings.proxy_retry_after_s))
            raise ApiError(503, str(exc), code="backend_unavailable",
                           headers={"Retry-After": retry}) from exc  # fmt: skip
        except BackendRejected as exc:
            status = 413 if exc.status == 413 else 400
            self._failed(ro, call_id, str(exc), status, exc.backend)
            raise ApiError(status, str(exc), code="backend_rejected") from exc
        except BackendError as exc:
            self._failed(ro, call_id, str(exc), 502, exc.backend)
            raise ApiError(502, str(exc), code="backend_error") from exc

    def _failed(self, ro: OpenRollout, call_id: str, message: str, code: int, backend: str) -> None:
        ro.errors += 1
        with contextlib.suppress(RecorderUsageError):  # finished meanwhile
            ro.handle.error("proxy", message, code=code, call_id=call_id, backend=backend)

    def _record(self, ro: OpenRollout, call_id: str, prompt: np.ndarray, out: Completion,
                drift: int) -> None:  # fmt: skip
        ro.calls += 1
        ro.drift_tokens += drift
        try:
            ro.handle.llm_call(
                prompt, out.token_ids, out.logprobs, call_id=call_id,
                finish_reason=out.finish_reason, model=out.model or self.model,
                backend=out.backend, policy_version=out.policy_version,
                latency_ms=out.latency_s * 1000.0, drift_tokens=drift,
            )  # fmt: skip
        except RecorderUsageError as exc:  # the rollout was finished while the call ran
            raise ApiError(409, str(exc), code="rollout_finished") from exc

    async def chat_completions(self, request: Request) -> Response:
        ro = self._open(request)
        body = await read_json(request, self.settings.proxy_max_body_bytes)
        return _response(*await self.chat_call(ro, body))

    async def completions(self, request: Request) -> Response:
        ro = self._open(request)
        body = await read_json(request, self.settings.proxy_max_body_bytes)
        return _response(*await self.text_call(ro, body))

    async def chat_call(self, ro: OpenRollout, body: dict[str, Any]) -> tuple[bytes, bool]:
        """A validated chat completion for ``ro``: (answer body, is it SSE). Raises ApiError."""
        try:
            messages = normalize_messages(body.get("messages"))
            tools = normalize_tools(body.get("tools"))
        except ChatInputError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from exc
        call = parse_call(body, self.chat)
        tools_on = tools is not None and body.get("tool_choice") != "none"
        gen_prompt = flag(body, "add_generation_prompt", True)
        try:
            prompt = render_prompt(self.chat, ro.memory, messages, tools,
                                   add_generation_prompt=gen_prompt)  # fmt: skip
        except ChatInputError as exc:
            raise ApiError(400, str(exc), param=exc.param or "messages") from exc
        max_tokens = self._budget(len(prompt.ids), call.max_tokens,
                                  self.settings.proxy_default_max_tokens)  # fmt: skip
        call_id = new_ulid()
        for tr in tool_results(ro.memory, messages):
            with contextlib.suppress(RecorderUsageError):
                ro.handle.tool_call(tr.name, tr.arguments, tr.result, at_call_id=tr.at_call_id,
                                    tool_call_id=tr.tool_call_id)  # fmt: skip
        out = await self._generate(ro, call_id, prompt.ids, call, max_tokens)
        ids = out.token_ids
        user_stop = out.stop_reason is not None and len(ids) and int(ids[-1]) == out.stop_reason
        reply = parse_reply(self.chat, ids[:-1] if user_stop else ids, tools_enabled=tools_on)
        ro.memory.remember(len(messages), reply, ids, call_id)
        self._record(ro, call_id, prompt.ids, out, prompt.drift_tokens)

        finish = "tool_calls" if reply.tool_calls else FINISH_REASONS.get(out.finish_reason, "stop")
        use = usage(len(prompt.ids), len(ids))
        head = {"id": f"chatcmpl-{call_id}", "created": int(time.time()), "model": self.model}
        logprobs = self._logprobs(out) if call.logprobs else None
        if call.stream:
            chunks = chat_chunks(head, reply, finish, use if call.include_usage else None, logprobs)
            return sse_body(chunks), True
        choice: dict[str, Any] = {"index": 0, "message": reply.message(), "logprobs": logprobs,
                                  "finish_reason": finish}  # fmt: skip
        return self._answer(head | {"object": "chat.completion"}, choice, use, call, prompt.ids,
                            out, ro, drift_tokens=prompt.drift_tokens), False  # fmt: skip

    def _answer(
        self, head: dict[str, Any], choice: dict[str, Any], use: dict[str, int], call: CallParams,
        prompt: np.ndarray, out: Completion, ro: OpenRollout, **ext: Any,
    ) -> bytes:  # fmt: skip
        if call.return_token_ids:
            choice["token_ids"] = out.token_ids.tolist()
            choice["prompt_token_ids"] = prompt.tolist()
        ext |= {"call_id": head["id"].partition("-")[2], "rollout_id": ro.rollout_id,
                "backend": out.backend, "policy_version": out.policy_version}  # fmt: skip
        return dumps(head | {"choices": [choice], "usage": use, "rollstream": ext})

    def _logprobs(self, out: Completion) -> dict[str, Any]:
        texts = self.chat.tokenizer.decode_batch([[t] for t in out.token_ids.tolist()],
                                                 skip_special_tokens=False)  # fmt: skip
        lps = out.logprobs.tolist()
        return {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                            for t, lp in zip(texts, lps, strict=True)]}  # fmt: skip

    async def text_call(self, ro: OpenRollout, body: dict[str, Any]) -> tuple[bytes, bool]:
        """A validated text completion for ``ro``: (answer body, is it SSE). Raises ApiError."""
        prompt = self._text_prompt(body.get("prompt"))
        call = parse_call(body, self.chat)
        max_tokens = self._budget(len(prompt), call.max_tokens, 16)
        call_id = new_ulid()
        out = await self._generate(ro, call_id, prompt, call, max_tokens)
        self._record(ro, call_id, prompt, out, 0)
        text = self.chat.decode(out.token_ids)
        finish = FINISH_REASONS.get(out.finish_reason, "stop")
        use = usage(len(prompt), len(out.token_ids))
        head = {"id": f"cmpl-{call_id}", "object": "text_completion", "created": int(time.time()),
                "model": self.model}  # fmt: skip
        if call.stream:
            chunks = text_chunks(head, text, finish, use if call.include_usage else None)
            return sse_body(chunks), True
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._answer(head, choice, use, call, prompt, out, ro), False

    def _text_prompt(self, raw: Any) -> np.ndarray:
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
            raw = raw[0]
        if isinstance(raw, str) and raw:
            return self.chat.encode(raw)
        if isinstance(raw, list) and raw and all(type(t) is int for t in raw):
            ids = np.asarray(raw, dtype=np.int64)
            vocab = self.chat.tokenizer.get_vocab_size(with_added_tokens=True)
            if ids.min() < 0 or ids.max() >= vocab:
                raise ApiError(400, f"token ids must be in [0, {vocab})", param="prompt")
            return ids.astype(np.uint32)
        raise ApiError(400, "`prompt` must be a non-empty string or list of token ids (one prompt)",
                       param="prompt")  # fmt: skip

    # --- other routes ------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        if "rollout_id" in request.path_params:
            self._open(request)
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "rollstream",
                "max_model_len": self.max_model_len,
                "policy_version": self.pool.policy_version}  # fmt: skip
        return json_response({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        healthy = sum(m.healthy for m in self.pool.members)
        return json_response({"status": "ok" if healthy else "degraded", "backends": healthy},
                             200 if healthy else 503)  # fmt: skip

    async def openapi(self, request: Request) -> Response:
        return json_response(OPENAPI)

    def _timeout(self, request: Request) -> float | None:
        raw = request.query_params.get("timeout")
        try:
            return float(raw) if raw else None
        except ValueError:
            raise ApiError(400, "`timeout` must be a number of seconds", param="timeout") from None

    async def admin_pause(self, request: Request) -> Response:
        self.auth.admin(request)
        self.pool.pause()
        drained = None
        if request.query_params.get("drain") in ("1", "true"):
            drained = await self.pool.drain(self._timeout(request))
        return json_response({"paused": True, "drained": drained, "inflight": self.pool.inflight})

    async def admin_drain(self, request: Request) -> Response:
        self.auth.admin(request)
        drained = await self.pool.drain(self._timeout(request))
        return json_response({"paused": self.pool.paused, "drained": drained,
                              "inflight": self.pool.inflight})  # fmt: skip

    async def admin_resume(self, request: Request) -> Response:
        self.auth.admin(request)
        self.pool.resume()
        return json_response({"paused": False})

    async def admin_update_weights(self, request: Request) -> Response:
        self.auth.admin(request)
        body = await read_json(request, self.settings.proxy_max_body_bytes)
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise ApiError(400, "`path` must be a non-empty string", param="path")
        version = number(body, "version", None, lo=0)
        if version is None:
            raise ApiError(400, "`version` is required", param="version")
        try:
            return json_response(await self.pool.update_weights(path, version))
        except PoolError as exc:
            raise ApiError(503, str(exc), code="update_failed") from exc

    async def admin_status(self, request: Request) -> Response:
        self.auth.admin(request)
        r = self.rollouts
        open_ = r.open.values()
        return json_response({
            **self.pool.status(),
            "open_rollouts": len(r.open), "created_rollouts": r.created,
            "drift_tokens_open": sum(ro.drift_tokens for ro in open_),
            "delivery": dataclasses.asdict(self.recorder.stats),
        })  # fmt: skip


# --------------------------------------------------------------------------- app


def _response(body: bytes, is_sse: bool) -> Response:
    if is_sse:
        return Response(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return Response(body, media_type="application/json")


def _guard(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Any]:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc)
        except ChatError as exc:
            return error_response(ApiError(400, str(exc)))
        except Exception as exc:  # a 500 with the reason, never a dropped connection
            log.exception("unhandled error on %s", request.url.path)
            return error_response(ApiError(500, f"{type(exc).__name__}: {exc}", code="internal"))

    return wrapped


def build_pool(settings: ProxySettings) -> BackendPool:
    s = settings
    return BackendPool.from_urls(
        s.proxy_backends, kind=s.proxy_backend_kind, model=s.proxy_backend_model,
        api_key=s.proxy_backend_api_key.get_secret_value() if s.proxy_backend_api_key else None,
        timeout_s=s.proxy_backend_timeout_s, health_interval_s=s.proxy_health_interval_s,
        backend_wait_s=s.proxy_backend_wait_s, pause_wait_s=s.proxy_pause_wait_s,
        retry_after_s=s.proxy_retry_after_s,
    )  # fmt: skip


def create_app(
    settings: ProxySettings,
    *,
    recorder: Recorder | None = None,
    pool: BackendPool | None = None,
    chat: ChatTemplate | None = None,
) -> Starlette:
    """Build the proxy app. A recorder or pool passed in is the caller's (not closed here);
    ones built from ``settings`` are closed at shutdown. ``app.state.proxy`` is the Proxy."""
    own_recorder, own_pool = recorder is None, pool is None
    recorder = recorder or Recorder(settings)
    pool = pool or build_pool(settings)
    chat = chat or ChatTemplate.from_dir(
        settings.resolved_model_path(), max_model_len=settings.proxy_max_model_len
    )
    proxy = Proxy(settings, recorder=recorder, pool=pool, chat=chat)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await proxy.start()
        watcher = None
        if settings.proxy_follow_policy:
            watcher = PolicyWatcher(
                settings,
                asyncio.get_running_loop(),
                pool.update_weights,
                lambda: pool.policy_version,
            ).start()
        try:
            yield
        finally:
            if watcher is not None:
                await asyncio.to_thread(watcher.stop)
            await proxy.stop()
            if own_pool:
                await pool.aclose()
            if own_recorder:
                await asyncio.to_thread(recorder.close)

    p = proxy
    get, post = ["GET"], ["POST"]
    table: list[tuple[str, Callable[[Request], Awaitable[Response]], list[str]]] = [
        ("/rollouts/{rollout_id}/v1/chat/completions", p.chat_completions, post),
        ("/rollouts/{rollout_id}/v1/completions", p.completions, post),
        ("/rollouts/{rollout_id}/v1/models", p.models, get),
        ("/v1/chat/completions", p.chat_completions, post),
        ("/v1/completions", p.completions, post),
        ("/v1/models", p.models, get),
        ("/v1/rollouts", p.api.create, post),
        ("/v1/rollouts/{rollout_id}", p.api.get, get),
        ("/v1/rollouts/{rollout_id}/rewards", p.api.rewards, post),
        ("/v1/rollouts/{rollout_id}/tool_calls", p.api.tool_calls, post),
        ("/v1/rollouts/{rollout_id}/finish", p.api.finish, post),
        ("/v1/admin/pause", p.admin_pause, post),
        ("/v1/admin/drain", p.admin_drain, post),
        ("/v1/admin/resume", p.admin_resume, post),
        ("/v1/admin/update_weights", p.admin_update_weights, post),
        ("/v1/admin/status", p.admin_status, get),
        ("/health", p.health, get),
        ("/openapi.json", p.openapi, get),
    ]
    app = ProxyApp(
        routes=[Route(path, _guard(h), methods=m) for path, h, m in table], lifespan=lifespan
    )
    app.proxy = app.state.proxy = proxy
    return app


def run(settings: ProxySettings) -> None:
    """Serve until interrupted (``rollstream proxy`` calls this)."""
    logging.basicConfig(level=settings.proxy_log_level.upper())
    uvicorn.run(
        create_app(settings), host=settings.proxy_host, port=settings.proxy_port,
        log_level=settings.proxy_log_level, access_log=False, timeout_keep_alive=30,
    )  # fmt: skip


if __name__ == "__main__":
    run(ProxySettings())
