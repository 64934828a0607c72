"""The recording OpenAI-compatible proxy: a harness changes only its base_url and every model call
becomes an LlmCall event with the token IDs that were actually sampled. This module is the
service and knows no HTTP framework; app.py serves it over ASGI (Starlette + a raw fast path).

    harness --(OpenAI HTTP, base_url=/rollouts/{id}/v1)--> proxy --(token ids)--> backend pool
                                                             `--> Recorder (SDK) --> Kafka

Routes (docs/proxy.md; GET /openapi.json describes them; ``Proxy.endpoints()`` is the table):
    POST /rollouts/{rollout_id}/v1/chat/completions   stream or not, tools / tool_calls
    POST /rollouts/{rollout_id}/v1/completions        prompt as text or token ids
    GET  /rollouts/{rollout_id}/v1/models
    POST /rollouts/{rollout_id}/v1/messages           Anthropic's Messages API (messages_api.py)
    POST /v1/chat/completions, /v1/completions        the same; the rollout is the token's
    POST /v1/messages
    POST /rollouts/{rollout_id}/v1/responses, /v1/responses   OpenAI's Responses API
                                                               (responses_api.py)
    GET  /v1/models, /health, /openapi.json
    the rollout API (rollout_api.py), the job routes /v1/jobs (jobs_api.py), the OTLP/HTTP
    trace receiver /v1/traces (otlp_api.py) and the admin routes
    /v1/admin/{pause,drain,resume,update_weights,status}

Every request opened by a rollout token (the model calls above, the rollout API) is
rate-limited per rollout (``proxy_rate_limit_rps``, ``proxy_rate_limit_burst``; ratelimit.py):
429 ``rate_limit_exceeded`` with Retry-After, checked with the token, before the body is read.

One request, one pipeline. After the rollout token is checked (``open_rollout``) and the body
read (413 past the limit), a chat call is seven steps, each one function called once, in this
order, each consuming what the one before produced:

    1 parse      openai_wire.parse_chat_request   options validated (400); a response_format
                                                  the pool cannot decode under is refused (400)
    2 render     chat.render_turn                 messages normalized and rendered into token ids
                                                  with each earlier reply's generated ids spliced
                                                  in (drift counted); new tool results found
    3 budget     Proxy._budget                    prompt and max_tokens against the context (400
                                                  context_length_exceeded)
    4 generate   Proxy._generate -> BackendPool   n samples of the prompt, concurrently; sticky
                                                  backend, failover; 429 while paused; a failure
                                                  is recorded as a RolloutError (502/503)
    5 read       chat.read_replies                completions decoded, tool calls parsed, replies
                                                  remembered for the rollout's next turns
    6 record     Proxy._record -> RolloutHandle   tool results as ToolCall events, then one
                                                  LlmCall per choice (the context trie makes the
                                                  delta)
    7 answer     openai_wire.chat_answer          chat.completion JSON or its SSE chunks

Steps 2 to 6 are ``Proxy.turn``, called once per call by every API that speaks chat: chat
completions here, Anthropic Messages (messages_api.py) and OpenAI Responses (responses_api.py)
parse their own wire into a ChatRequest (step 1) and build their own answer (step 7).

A text completion is the same with ``parse_text_request``, ``render_text`` (step 2), the
template's ``decode`` (step 5) and ``text_answer``.

Choices (``n`` > 1): n samples of the same prompt, one LlmCall each, recorded in choice order
with the same full prompt. Choice 0 attaches where a single call would; the context trie
attaches choice i > 0 to choice i-1 with ``prefix_len`` = the prompt's length and an empty delta,
which the trajectory tree (streams/core/tree.py) reads as a branch of choice 0 at the end of its
prompt, beside its completion. The tool results and the drift go with choice 0. Every reply is
remembered: the harness's next request tells which choice it kept, and the next call extends
that one.

Streaming (``stream: true`` with one choice; stream_turn.py): steps 2 to 4 run up to the
backend's FIRST token (``open_stream``: the pool's failover applies until then, and every
failure is an HTTP error answer); then the answer is sent as the tokens arrive (content deltas
decoded incrementally, held back where a tool-call marker may start), and steps 5 and 6 (read,
record) run once after the last token, on the whole reply. A backend failure after the first
token ends the stream with an error event; a client that hangs up closes the backend request;
both are recorded as a RolloutError, not an LlmCall. With ``n`` > 1 the choices are generated
whole and then sent as SSE (per choice, index 0 first: a role chunk, a content chunk, a
tool_calls chunk and the finish chunk; then an optional usage chunk, ``data: [DONE]``).

Errors: ApiError (producers/errors.py) becomes ``{"error": {"message", "type", "param",
"code"}}``; a ChatInputError a 400 with its param and code (openai_wire.as_api_error).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollstream.producers.errors import (
    ApiError,
    BackendError,
    BackendRejected,
    NoBackendAvailable,
    PoolError,
    PoolPaused,
    ProxyError,
)
from rollstream.producers.proxy.backends import Completion
from rollstream.producers.proxy.chat import (
    ChatTemplate,
    ChatTurn,
    ToolResult,
    read_replies,
    render_text,
    render_turn,
)
from rollstream.producers.proxy.jobs_api import JobsApi
from rollstream.producers.proxy.messages_api import MessagesApi
from rollstream.producers.proxy.openai_wire import (
    Answer,
    CallParams,
    ChatChoice,
    ChatRequest,
    HttpRequest,
    chat_answer,
    json_answer,
    number,
    parse_chat_request,
    parse_text_request,
    text_answer,
)
from rollstream.producers.proxy.openapi import OPENAPI
from rollstream.producers.proxy.otlp_api import OtlpApi
from rollstream.producers.proxy.policy_watch import PolicyWatcher
from rollstream.producers.proxy.pool import BackendPool
from rollstream.producers.proxy.ratelimit import RateLimiter
from rollstream.producers.proxy.responses_api import ResponsesApi
from rollstream.producers.proxy.rollout_api import (
    Auth,
    OpenRollout,
    RolloutApi,
    Rollouts,
    RolloutTokens,
)
from rollstream.producers.proxy.settings import ProxySettings
from rollstream.producers.proxy.stream_turn import StreamedTurn, chat_events
from rollstream.producers.proxy.turns import Turn
from rollstream.producers.sdk.ids import new_ulid
from rollstream.producers.sdk.recorder import Recorder, RecorderUsageError

__all__ = [
    "ApiError",
    "Endpoint",
    "Proxy",
    "ProxyError",
    "ProxySettings",
    "build_pool",
    "build_proxy",
    "new_ulid",
]

log = logging.getLogger("rollstream.producers.proxy.service")

Handler = Callable[[HttpRequest], Awaitable[Answer]]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One route of the proxy: a path (``{name}`` marks a path parameter), its method and the
    handler that answers it."""

    path: str
    method: str
    handler: Handler


def context_exceeded(message: str, param: str) -> ApiError:
    """A context overflow as OpenAI answers it: 400, ``invalid_request_error``, code
    ``context_length_exceeded``."""
    return ApiError(400, message, param=param, code="context_length_exceeded")


class Proxy:
    """The proxy's state and handlers. app.py serves one over ASGI; the rollout service and the
    trainer may also use it from Python (``create_rollout``, ``chat_call``, ``pool``)."""

    def __init__(
        self,
        settings: ProxySettings,
        *,
        recorder: Recorder,
        pool: BackendPool,
        chat: ChatTemplate,
        owns_recorder: bool = False,
        owns_pool: bool = False,
    ) -> None:
        self.settings, self.recorder, self.pool, self.chat = settings, recorder, pool, chat
        self._owns_recorder, self._owns_pool = owns_recorder, owns_pool
        s = settings
        secret = s.proxy_token_secret.get_secret_value().encode() if s.proxy_token_secret else None
        limiter = None
        if s.proxy_rate_limit_rps > 0:
            limiter = RateLimiter(
                s.proxy_rate_limit_rps, s.proxy_rate_limit_burst, clock=time.monotonic
            )
        self.auth = Auth(
            RolloutTokens(secret or secrets.token_bytes(32)),
            [k.get_secret_value() for k in s.proxy_api_keys],
            evaluator_keys=[k.get_secret_value() for k in s.proxy_evaluator_keys],
            limiter=limiter,
        )
        self.rollouts = Rollouts(
            recorder,
            pool,
            max_open=s.proxy_max_open_rollouts,
            max_calls=s.proxy_max_rollout_calls,
            max_tokens=s.proxy_max_rollout_tokens,
        )
        self.api = RolloutApi(self.rollouts, self.auth, public_url=s.proxy_public_url)
        self.jobs = JobsApi(settings, self.auth)
        self.otlp = OtlpApi(self.rollouts, self.auth, max_body_bytes=s.proxy_max_body_bytes)
        self.max_model_len = s.proxy_max_model_len or chat.max_model_len
        self.max_prompt = s.proxy_max_prompt_tokens or self.max_model_len
        self.model = s.proxy_model_name
        self.watcher: PolicyWatcher | None = None
        self._sweeper: asyncio.Task[None] | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Probe the backends, start the idle-rollout sweeper and, with
        ``proxy_follow_policy``, the policy watcher."""
        if self.auth.admin_open:
            log.warning("no proxy_api_keys set: the admin and rollout-creation routes are open")
        await self.pool.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="proxy-sweeper")
        if self.settings.proxy_follow_policy:
            pool = self.pool
            self.watcher = PolicyWatcher(
                self.settings,
                asyncio.get_running_loop(),
                pool.update_weights,
                lambda: pool.policy_version,
            ).start()

    async def stop(self) -> None:
        """Stop the watcher and the sweeper, finish the open rollouts (aborted), and close the
        pool and the recorder if they were built here (``build_proxy``)."""
        if self.watcher is not None:
            await asyncio.to_thread(self.watcher.stop)
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        self.rollouts.close("the proxy shut down")
        await asyncio.to_thread(self.jobs.close)
        if self._owns_pool:
            await self.pool.aclose()
        if self._owns_recorder:
            await asyncio.to_thread(self.recorder.close)

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
        return {
            "rollout_id": rid,
            "base_url": f"{base_url.rstrip('/')}/rollouts/{rid}/v1",
            "token": self.auth.tokens.issue(rid),
        }

    def open_rollout(self, token: str | None, rollout_id: str | None) -> OpenRollout:
        """The open rollout a model call with bearer ``token`` writes: the URL's ``rollout_id``
        or, on an unscoped URL, the token's (401, 403, 404, 409; 409 ``rollout_too_large``
        past the per-rollout bounds)."""
        ro = self.rollouts.get(self.auth.rollout_of(token, rollout_id))
        self.rollouts.room_for_a_call(ro)
        return ro

    # --- the pipeline of a model call ----------------------------------------------------------

    async def turn(
        self,
        ro: OpenRollout,
        request: ChatRequest,
        *,
        default_max_tokens: int | None = None,
        format_param: str = "response_format",
        overflow: Callable[[ApiError, int, int], ApiError] | None = None,
    ) -> Turn:
        """Steps 2 to 6 of a call in any API's words (chat, Messages, Responses), once its
        request is parsed into a ChatRequest: render, budget, generate (``params.n`` choices),
        read the replies, record one LlmCall per choice (the tool results and the drift go with
        choice 0). A ``response_format`` the pool cannot decode under is a 400 on
        ``format_param``; ``overflow(error, prompt_tokens, max_tokens)`` words a context
        overflow as the API does. Raises ApiError or ChatInputError."""
        params = request.params
        turn = self._render(ro, request, format_param)  # 2 render
        prompt = turn.prompt.ids
        default = default_max_tokens or self.settings.proxy_default_max_tokens
        try:
            # 3 budget
            max_tokens = self._budget(len(prompt), params.max_tokens, default)
            call_ids = [new_ulid() for _ in range(params.n)]
            # 4 generate
            outs = await self._generate(
                ro,
                call_ids[0],
                prompt,
                params,
                turn.stop_token_ids,
                max_tokens,
                turn.tool_results,
                response_format=request.response_format,
            )
        except ApiError as exc:
            if overflow is None or exc.code != "context_length_exceeded":
                raise
            raise overflow(exc, len(prompt), params.max_tokens or default) from exc
        # 5 read the replies
        replies = read_replies(
            self.chat,
            ro.memory,
            turn,
            [(out.token_ids, out.stop_reason, _top_ids(out)) for out in outs],
            call_ids,
            token_texts=params.logprobs,
        )
        # 6 record: one LlmCall per choice; the tool results and the drift go with choice 0
        drift = turn.prompt.drift_tokens
        for i, (call_id, out) in enumerate(zip(call_ids, outs, strict=True)):
            tools = turn.tool_results if i == 0 else []
            self._record(ro, call_id, prompt, out, drift if i == 0 else 0, tools)
        return Turn(turn, prompt, outs, replies, call_ids, drift)

    def _render(self, ro: OpenRollout, request: ChatRequest, format_param: str) -> ChatTurn:
        """Step 2 (and the response_format check before it)."""
        if request.response_format is not None and not self.pool.guided_decoding:
            kind = request.response_format["type"]
            msg = (
                f"{format_param} {kind} needs a backend with guided decoding (vLLM); this "
                "proxy's backends cannot constrain the reply"
            )
            raise ApiError(400, msg, param=format_param, code="unsupported")
        return render_turn(
            self.chat,
            ro.memory,
            messages=request.messages,
            tools=request.tools,
            tool_choice=request.tool_choice,
            add_generation_prompt=request.add_generation_prompt,
            stop=request.params.stop,
        )

    async def open_stream(
        self,
        ro: OpenRollout,
        request: ChatRequest,
        *,
        default_max_tokens: int | None = None,
        format_param: str = "response_format",
        overflow: Callable[[ApiError, int, int], ApiError] | None = None,
    ) -> StreamedTurn:
        """A streamed call (one choice) up to the backend's first token: steps 2 to 4 as in
        ``turn`` (render, budget, the pool's routing and failover; every failure an ApiError,
        answered with its status), then a StreamedTurn whose ``deltas()`` give the rest as it
        is generated and read and record the reply after the last token (stream_turn.py)."""
        params = request.params
        started = time.perf_counter()
        turn = self._render(ro, request, format_param)
        prompt = turn.prompt.ids
        default = default_max_tokens or self.settings.proxy_default_max_tokens
        call_id = new_ulid()
        try:
            max_tokens = self._budget(len(prompt), params.max_tokens, default)
            extra: dict[str, Any] = {}
            if params.top_logprobs:
                extra["top_logprobs"] = params.top_logprobs
            if request.response_format is not None:
                extra["response_format"] = request.response_format
            chunks = self.pool.stream(
                ro.rollout_id,
                prompt,
                max_tokens=max_tokens,
                stop_token_ids=turn.stop_token_ids or None,
                **params.sampling,
                **extra,
            )
            with self._call_failures(ro, call_id, turn.tool_results):
                first = await anext(chunks)
        except ApiError as exc:
            if overflow is None or exc.code != "context_length_exceeded":
                raise
            raise overflow(exc, len(prompt), params.max_tokens or default) from exc
        return StreamedTurn(
            chat=self.chat,
            ro=ro,
            turn=turn,
            prompt=prompt,
            call_id=call_id,
            params=params,
            first=first,
            chunks=chunks,
            drift=turn.prompt.drift_tokens,
            model=self.model,
            record=self._record,
            fail=self._failed,
            started=started,
        )

    async def chat_call(self, ro: OpenRollout, body: dict[str, Any]) -> Answer:
        """A chat completion for ``ro`` (see the module docstring for its seven steps). Raises
        ApiError or ChatInputError."""
        # 1 parse
        request = parse_chat_request(body)
        params = request.params
        if params.stream and params.n == 1:  # 2-4 now, 5-7 as the tokens come
            call = await self.open_stream(ro, request)
            events = chat_events(call, created=int(time.time()), rollout_id=ro.rollout_id)
            return Answer(b"", sse=True, stream=events)
        # 2-6
        done = await self.turn(ro, request)
        outs, replies, call_ids, prompt = done.outs, done.replies, done.call_ids, done.prompt
        drift = done.drift
        # 7 answer
        choices = [
            ChatChoice(
                out,
                reply.message(),
                call_id,
                token_texts=reply.token_texts,
                top_texts=reply.top_texts,
                tool_choice_met=reply.tool_choice_met,
            )
            for out, reply, call_id in zip(outs, replies, call_ids, strict=True)
        ]
        return chat_answer(
            params,
            created=int(time.time()),
            model=self.model,
            rollout_id=ro.rollout_id,
            prompt_ids=prompt,
            choices=choices,
            drift_tokens=drift,
        )

    async def text_call(self, ro: OpenRollout, body: dict[str, Any]) -> Answer:
        """A text completion for ``ro``: the chat pipeline's steps without messages. Raises
        ApiError or ChatInputError."""
        request = parse_text_request(body)
        params = request.params
        turn = render_text(self.chat, request.prompt, params.stop)
        max_tokens = self._budget(len(turn.ids), params.max_tokens, 16)
        call_id = new_ulid()
        (out,) = await self._generate(
            ro, call_id, turn.ids, params, turn.stop_token_ids, max_tokens, []
        )
        text = self.chat.decode(out.token_ids)
        self._record(ro, call_id, turn.ids, out, 0, [])
        return text_answer(
            params,
            call_id=call_id,
            created=int(time.time()),
            model=self.model,
            rollout_id=ro.rollout_id,
            prompt_ids=turn.ids,
            out=out,
            text=text,
        )

    def _budget(self, prompt_len: int, requested: int | None, default: int) -> int:
        """Step 3: the max_tokens to ask for. A prompt or request that does not fit is a 400
        ``context_length_exceeded`` worded as OpenAI and vLLM word it, so client libraries
        classify it as a context overflow (and do not retry it)."""
        if self.max_prompt and prompt_len > self.max_prompt:
            msg = (
                f"This model's maximum context length is {self.max_prompt} tokens for the "
                f"prompt (the proxy's limit). However, your messages resulted in {prompt_len} "
                "tokens. Please reduce the length of the messages."
            )
            raise context_exceeded(msg, "messages")
        room = self.max_model_len - prompt_len if self.max_model_len else None
        if requested is None:
            budget = default if room is None else min(default, room)
            if budget < 1:
                msg = (
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, your messages resulted in {prompt_len} tokens. Please reduce "
                    "the length of the messages."
                )
                raise context_exceeded(msg, "messages")
            return budget
        if room is not None and requested > room:
            msg = (
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_len + requested} tokens ({prompt_len} in "
                f"the messages, {requested} in the completion). Please reduce the length of "
                "the messages or completion."
            )
            raise context_exceeded(msg, "max_tokens")
        return requested

    async def _generate(
        self,
        ro: OpenRollout,
        call_id: str,
        prompt: np.ndarray,
        params: CallParams,
        stop_token_ids: list[int],
        max_tokens: int,
        tool_results: list[ToolResult],
        *,
        response_format: dict[str, Any] | None = None,
    ) -> list[Completion]:
        """Step 4: ``params.n`` completions from the pool, sampled concurrently (with a
        ``seed``, choice i gets seed + i, so the choices differ). A failure after the call was
        accepted is recorded once (with the request's tool results first, under ``call_id``),
        the other samples are cancelled, and it is answered 502/503/400; a paused pool is a 429
        with Retry-After, not recorded (the harness retries)."""
        extra: dict[str, Any] = {}
        if params.top_logprobs:
            extra["top_logprobs"] = params.top_logprobs
        if response_format is not None:
            extra["response_format"] = response_format
        seed: int | None = params.sampling.get("seed")
        samples = [
            self.pool.complete(
                ro.rollout_id,
                prompt,
                max_tokens=max_tokens,
                stop_token_ids=stop_token_ids or None,
                **(params.sampling if seed is None else {**params.sampling, "seed": seed + i}),
                **extra,
            )
            for i in range(params.n)
        ]
        with self._call_failures(ro, call_id, tool_results):
            return await _all(samples)
        raise AssertionError("unreachable")  # pragma: no cover - the block returns or raises

    @contextlib.contextmanager
    def _call_failures(
        self, ro: OpenRollout, call_id: str, tool_results: list[ToolResult]
    ) -> Iterator[None]:
        """The pool's failures of a call as answers: a paused pool is a 429 with Retry-After,
        not recorded (the harness retries); any other is recorded once as a RolloutError
        (with the request's tool results first, under ``call_id``) and answered 503 (no
        backend), 400 (the backend rejected it) or 502."""
        try:
            yield
        except PoolPaused as exc:
            retry = str(math.ceil(exc.retry_after_s))
            raise ApiError(429, str(exc), code="paused", headers={"Retry-After": retry}) from exc
        except NoBackendAvailable as exc:
            backend = exc.last_error.backend if exc.last_error else ""
            self._failed(ro, call_id, tool_results, str(exc), 503, backend)
            retry = str(math.ceil(self.settings.proxy_retry_after_s))
            raise ApiError(
                503, str(exc), code="backend_unavailable", headers={"Retry-After": retry}
            ) from exc
        except BackendRejected as exc:
            self._failed(ro, call_id, tool_results, str(exc), 400, exc.backend)
            if exc.status == 413:  # the backend's own context check
                raise context_exceeded(str(exc), "messages") from exc
            raise ApiError(400, str(exc), code="backend_rejected") from exc
        except BackendError as exc:
            self._failed(ro, call_id, tool_results, str(exc), 502, exc.backend)
            raise ApiError(502, str(exc), code="backend_error") from exc

    def _record_tool_results(self, ro: OpenRollout, tool_results: list[ToolResult]) -> None:
        for tr in tool_results:
            if ro.memory.claim_tool_result(tr.tool_call_id):  # once, whichever call records it
                with contextlib.suppress(RecorderUsageError):  # finished meanwhile
                    ro.handle.tool_call(
                        tr.name,
                        tr.arguments,
                        tr.result,
                        at_call_id=tr.at_call_id,
                        tool_call_id=tr.tool_call_id,
                    )

    def _failed(
        self,
        ro: OpenRollout,
        call_id: str,
        tool_results: list[ToolResult],
        message: str,
        code: int,
        backend: str,
    ) -> None:
        self._record_tool_results(ro, tool_results)
        ro.errors += 1
        with contextlib.suppress(RecorderUsageError):  # finished meanwhile
            ro.handle.error("proxy", message, code=code, call_id=call_id, backend=backend)

    def _record(
        self,
        ro: OpenRollout,
        call_id: str,
        prompt: np.ndarray,
        out: Completion,
        drift: int,
        tool_results: list[ToolResult],
    ) -> None:
        """Step 6: the tool results, then the LlmCall, through the rollout's handle (409 when
        the rollout was finished while the call ran). A completion cut by interrupting weight
        updates (``out.parts``) is one LlmCall per part, each extending the one before (its
        prompt is the prompt and the tokens so far, finish_reason "abort" but the last), so
        every token is on the log with the version that sampled it; ``call_id`` is the last."""
        self._record_tool_results(ro, tool_results)
        ro.calls += max(1, len(out.parts))
        ro.drift_tokens += drift
        parts = out.parts or ((len(out.token_ids), out.policy_version),)
        last = len(parts) - 1
        try:
            start = 0
            for i, (n, version) in enumerate(parts):
                ro.handle.llm_call(
                    np.concatenate([prompt, out.token_ids[:start]]) if start else prompt,
                    out.token_ids[start : start + n],
                    out.logprobs[start : start + n],
                    call_id=call_id if i == last else None,
                    finish_reason=out.finish_reason if i == last else "abort",
                    model=out.model or self.model,
                    backend=out.backend,
                    policy_version=version,
                    latency_ms=out.latency_s * 1000.0 if i == last else 0.0,
                    drift_tokens=drift if i == 0 else 0,
                )
                start += n
        except RecorderUsageError as exc:
            if ro.handle.finished:
                raise ApiError(409, str(exc), code="rollout_finished") from exc
            # the backend's answer broke a bound of the record (e.g. its policy version)
            raise ApiError(502, f"the backend's answer cannot be recorded: {exc}") from exc

    # --- routes ------------------------------------------------------------------------------

    async def chat_completions(self, request: HttpRequest) -> Answer:
        ro = self.open_rollout(request.token, request.path.get("rollout_id"))
        return await self.chat_call(ro, await request.json())

    async def completions(self, request: HttpRequest) -> Answer:
        ro = self.open_rollout(request.token, request.path.get("rollout_id"))
        return await self.text_call(ro, await request.json())

    async def models(self, request: HttpRequest) -> Answer:
        if "rollout_id" in request.path:
            self.rollouts.get(self.auth.rollout_of(request.token, request.path["rollout_id"]))
        card = {
            "id": self.model,
            "object": "model",
            "created": 0,
            "owned_by": "rollstream",
            "max_model_len": self.max_model_len,
            "policy_version": self.pool.policy_version,
        }
        return json_answer({"object": "list", "data": [card]})

    async def health(self, request: HttpRequest) -> Answer:
        healthy = sum(m.healthy for m in self.pool.members)
        body = {"status": "ok" if healthy else "degraded", "backends": healthy}
        return json_answer(body, 200 if healthy else 503)

    async def openapi(self, request: HttpRequest) -> Answer:
        return json_answer(OPENAPI)

    def _timeout(self, request: HttpRequest) -> float | None:
        raw = request.query.get("timeout")
        try:
            return float(raw) if raw else None
        except ValueError:
            raise ApiError(400, "`timeout` must be a number of seconds", param="timeout") from None

    async def admin_pause(self, request: HttpRequest) -> Answer:
        self.auth.admin(request.token)
        self.pool.pause()
        drained = None
        if request.query.get("drain") in ("1", "true"):
            drained = await self.pool.drain(self._timeout(request))
        return json_answer({"paused": True, "drained": drained, "inflight": self.pool.inflight})

    async def admin_drain(self, request: HttpRequest) -> Answer:
        self.auth.admin(request.token)
        drained = await self.pool.drain(self._timeout(request))
        pool = self.pool
        return json_answer({"paused": pool.paused, "drained": drained, "inflight": pool.inflight})

    async def admin_resume(self, request: HttpRequest) -> Answer:
        self.auth.admin(request.token)
        self.pool.resume()
        return json_answer({"paused": False})

    async def admin_update_weights(self, request: HttpRequest) -> Answer:
        self.auth.admin(request.token)
        body = await request.json()
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise ApiError(400, "`path` must be a non-empty string", param="path")
        version = number(body, "version", None, lo=0)
        if version is None:
            raise ApiError(400, "`version` is required", param="version")
        mode = body.get("mode")
        if mode is not None and mode not in ("drain", "interrupt"):
            raise ApiError(400, "`mode` must be drain or interrupt", param="mode")
        try:
            return json_answer(await self.pool.update_weights(path, version, mode))
        except PoolError as exc:
            raise ApiError(503, str(exc), code="update_failed") from exc

    async def admin_status(self, request: HttpRequest) -> Answer:
        self.auth.admin(request.token)
        r = self.rollouts
        return json_answer(
            {
                **self.pool.status(),
                "open_rollouts": len(r.open),
                "created_rollouts": r.created,
                "drift_tokens_open": sum(ro.drift_tokens for ro in r.open.values()),
                "delivery": dataclasses.asdict(self.recorder.stats),
                "otlp": dataclasses.asdict(self.otlp.stats),
                "rate_limited": limiter.limited if (limiter := self.auth.limiter) else 0,
                "refused_not_durable": r.refused_not_durable,
            }
        )

    def endpoints(self) -> list[Endpoint]:
        """Every route of the proxy. The model-call POSTs (chat completions, completions and
        messages, each in both URL forms) are also served by app.py's raw ASGI fast path, with
        the same answers."""
        api, anthropic, responses = self.api, MessagesApi(self), ResponsesApi(self)
        table: list[tuple[str, str, Handler]] = [
            ("/rollouts/{rollout_id}/v1/chat/completions", "POST", self.chat_completions),
            ("/rollouts/{rollout_id}/v1/completions", "POST", self.completions),
            ("/v1/chat/completions", "POST", self.chat_completions),
            ("/v1/completions", "POST", self.completions),
            ("/rollouts/{rollout_id}/v1/messages", "POST", anthropic.messages),
            ("/v1/messages", "POST", anthropic.messages),
            ("/rollouts/{rollout_id}/v1/responses", "POST", responses.responses),
            ("/v1/responses", "POST", responses.responses),
            ("/rollouts/{rollout_id}/v1/models", "GET", self.models),
            ("/v1/models", "GET", self.models),
            ("/v1/rollouts", "POST", api.create),
            ("/v1/rollouts/{rollout_id}", "GET", api.get),
            ("/v1/rollouts/{rollout_id}/rewards", "POST", api.rewards),
            ("/v1/rollouts/{rollout_id}/tool_calls", "POST", api.tool_calls),
            ("/v1/rollouts/{rollout_id}/branches", "POST", api.branches),
            ("/v1/rollouts/{rollout_id}/finish", "POST", api.finish),
            ("/v1/rollouts/{rollout_id}/events", "POST", api.events),
            ("/v1/traces", "POST", self.otlp.traces),
            ("/v1/jobs", "POST", self.jobs.submit),
            ("/v1/jobs", "GET", self.jobs.list),
            ("/v1/jobs/{job_id}", "GET", self.jobs.status),
            ("/v1/jobs/{job_id}/evaluator-token", "POST", self.jobs.evaluator_token),
            ("/v1/admin/pause", "POST", self.admin_pause),
            ("/v1/admin/drain", "POST", self.admin_drain),
            ("/v1/admin/resume", "POST", self.admin_resume),
            ("/v1/admin/update_weights", "POST", self.admin_update_weights),
            ("/v1/admin/status", "GET", self.admin_status),
            ("/health", "GET", self.health),
            ("/openapi.json", "GET", self.openapi),
        ]
        return [Endpoint(path, method, handler) for path, method, handler in table]


# --------------------------------------------------------------------------- helpers


async def _all(samples: list[Awaitable[Completion]]) -> list[Completion]:
    """Every sample's completion, in order; the first failure cancels the others (awaited, so
    none is left running) and is raised."""
    if len(samples) == 1:
        return [await samples[0]]
    tasks = [asyncio.ensure_future(s) for s in samples]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _top_ids(out: Completion) -> list[list[int]] | None:
    """The token ids of each step's alternatives (None when none were asked for)."""
    if out.top_logprobs is None:
        return None
    return [[t for t, _ in step] for step in out.top_logprobs]


# --------------------------------------------------------------------------- factories


def build_pool(settings: ProxySettings) -> BackendPool:
    """The backend pool of ``settings`` (one keep-alive client per backend URL)."""
    s = settings
    return BackendPool.from_urls(
        s.proxy_backends,
        kind=s.proxy_backend_kind,
        model=s.proxy_backend_model,
        api_key=s.proxy_backend_api_key.get_secret_value() if s.proxy_backend_api_key else None,
        admin_key=(
            s.proxy_backend_admin_key.get_secret_value() if s.proxy_backend_admin_key else None
        ),
        timeout_s=s.proxy_backend_timeout_s,
        http_client=s.proxy_http_client,
        health_interval_s=s.proxy_health_interval_s,
        backend_wait_s=s.proxy_backend_wait_s,
        pause_wait_s=s.proxy_pause_wait_s,
        retry_after_s=s.proxy_retry_after_s,
        weight_update_mode=s.proxy_weight_update_mode,
    )


def build_proxy(
    settings: ProxySettings,
    *,
    recorder: Recorder | None = None,
    pool: BackendPool | None = None,
    chat: ChatTemplate | None = None,
) -> Proxy:
    """A Proxy for ``settings``. A recorder or pool passed in is the caller's (not closed by
    ``Proxy.stop``); ones built here from ``settings`` are closed there."""
    chat = chat or ChatTemplate.from_dir(
        settings.resolved_model_path(),
        max_model_len=settings.proxy_max_model_len,
        tool_format=settings.proxy_tool_format,
    )
    return Proxy(
        settings,
        recorder=recorder or Recorder(settings),
        pool=pool or build_pool(settings),
        chat=chat,
        owns_recorder=recorder is None,
        owns_pool=pool is None,
    )
