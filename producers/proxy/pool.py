"""The proxy's inference backends: least-loaded sticky routing, health checks, failover, and the
pause / drain / resume cycle around weight updates.

Routing: a rollout is pinned to one backend for its whole life (its prefix stays in that
backend's KV cache). A new rollout goes to the healthy backend with the fewest active rollouts,
taken from a min-heap keyed by (active rollouts, arrival order); heap entries are invalidated
lazily (a stamp per backend), so routing costs O(log B). ``release(rollout_id)`` when the rollout
ends frees its slot.

Failures: a call that fails with BackendUnavailable (connection error, timeout, 5xx) takes the
backend out of the heap, moves the rollout to the next least-loaded healthy backend and retries
the SAME call there; nothing has been returned to the client yet, so nothing is lost or doubled.
When no backend is healthy the call waits for one up to ``backend_wait_s``, then fails with
NoBackendAvailable. BackendRejected (4xx) and BackendProtocolError are not retried: the request,
not the backend, is at fault. A health loop probes every backend each ``health_interval_s``;
a backend that answers again is readmitted, after reloading the current weights if it missed an
update.

Streams (``stream``): the same routing and failover until the first chunk of tokens arrives: a
backend that fails before it is replaced, and the call starts over there (the client has seen
nothing). After the first chunk the call is bound to that backend: a failure is raised to the
caller (it has sent tokens on), and the backend is marked down. A stream counts as in flight
until it is closed, so ``drain`` waits for it.

Weight updates (``update_weights(path, version, mode)``), two modes:

- ``drain`` (Agent Lightning's cycle): pause (new calls wait at the gate, up to ``pause_wait_s``,
  then get PoolPaused -> HTTP 429 with Retry-After), drain (wait for the calls in flight), reload
  every healthy backend, resume. Every completion comes from one policy version; the update
  waits for the longest generation in flight. The three steps are exposed separately for
  callers that reload the backends themselves.
- ``interrupt`` (partial rollouts, as AReaL's interruptible rollout workers): pause the gate,
  tell every healthy backend to pause with ``mode=abort`` (its generations in flight end now,
  finish_reason "abort", with the tokens sampled so far), reload, resume. A call whose
  generation was cut by the update waits at the gate, then goes on where it stopped on the new
  weights: the same request with the prompt extended by the tokens it has and ``max_tokens``
  reduced by them. Its Completion holds every token with the logprob of the policy that sampled
  it, and ``parts`` says which tokens came from which version (the proxy records one LlmCall
  per part, so each token keeps its version on the log). A stream goes on the same way: the
  last chunk before the update is marked ``part_end`` and the continuation's first chunk names
  its policy version. The update waits for no generation; ``interrupted`` counts the cut ones.
  An "abort" the pool did not cause (another client paused the backend) is returned as it is.

Errors (producers/errors.py): PoolError (a ProxyError), PoolPaused (the pool stayed paused
longer than the caller may wait), NoBackendAvailable (no healthy backend within
backend_wait_s; ``.last_error``). ``complete`` raises those, or the BackendError of a call that
must not be retried (BackendRejected, BackendProtocolError).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import numpy as np

from rollstream.producers.errors import (
    BackendError,
    BackendUnavailable,
    NoBackendAvailable,
    PoolError,
    PoolPaused,
    ProxyConfigError,
)
from rollstream.producers.proxy.backends import (
    AiohttpPost,
    BackendKind,
    Completion,
    CompletionBackend,
    TokenChunk,
)
from rollstream.producers.proxy.http1 import Http1Transport
from rollstream.producers.proxy.settings import HttpClient, WeightUpdateMode

__all__ = [
    "BackendPool",
    "Member",
    "NoBackendAvailable",
    "PoolError",
    "PoolPaused",
    "PoolStats",
]

log = logging.getLogger("rollstream.producers.proxy.pool")


class _Closeable(Protocol):
    async def aclose(self) -> None: ...


@dataclass(eq=False, slots=True)
class Member:
    """One backend in the pool and what the pool knows about it."""

    backend: CompletionBackend
    healthy: bool = True
    active: int = 0  # rollouts pinned here
    inflight: int = 0
    calls: int = 0
    failures: int = 0
    policy_version: int = 0
    last_error: str = ""
    stamp: int = 0  # bumped on every change; older heap entries are stale

    @property
    def name(self) -> str:
        return self.backend.name

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name, "url": self.backend.base_url, "kind": self.backend.kind,
            "healthy": self.healthy, "active_rollouts": self.active, "inflight": self.inflight,
            "calls": self.calls, "failures": self.failures,
            "policy_version": self.policy_version, "last_error": self.last_error,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class PoolStats:
    dispatched: int = 0  # backend calls started (retries included)
    completed: int = 0  # calls answered
    failovers: int = 0  # calls retried on another backend after a failure
    moved: int = 0  # rollouts moved off a failed backend
    paused_waits: int = 0  # calls that waited at the pause gate
    paused_rejects: int = 0  # calls refused because the pause lasted too long
    weight_updates: int = 0
    interrupted: int = 0  # generations cut by an interrupting weight update and continued
    prompt_tokens: int = 0  # prompt tokens of the calls answered (each choice counts its prompt)
    completion_tokens: int = 0  # tokens generated by the calls answered


class BackendPool:
    """Backends behind the proxy. Use from one event loop; ``start()`` before the first call."""

    def __init__(
        self,
        backends: Sequence[CompletionBackend],
        *,
        health_interval_s: float = 2.0,
        backend_wait_s: float = 30.0,
        pause_wait_s: float = 60.0,
        retry_after_s: float = 2.0,
        drain_timeout_s: float = 600.0,
        weight_update_mode: WeightUpdateMode = "drain",
        owned_clients: Sequence[_Closeable] = (),
    ) -> None:
        if not backends:
            raise PoolError("a backend pool needs at least one backend")
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise PoolError(f"backend names must be unique: {names}")
        self.members = [Member(b) for b in backends]
        self.health_interval_s = health_interval_s
        self.backend_wait_s = backend_wait_s
        self.pause_wait_s = pause_wait_s
        self.retry_after_s = retry_after_s
        self.drain_timeout_s = drain_timeout_s
        if weight_update_mode not in ("drain", "interrupt"):
            raise PoolError(f"unknown weight_update_mode {weight_update_mode!r}")
        self.weight_update_mode: WeightUpdateMode = weight_update_mode
        self._epoch = 0  # interrupting updates begun: a call cut by one sees it change
        self._clients = list(owned_clients)
        self._heap: list[tuple[int, int, int, Member]] = []
        self._order = itertools.count()
        self._sticky: dict[str, Member] = {}
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._member_up = asyncio.Event()
        self._inflight = 0
        self._update_lock = asyncio.Lock()
        self._target: tuple[str, int] | None = None  # weights every backend must serve
        self._health_task: asyncio.Task[None] | None = None
        self._counts = {f.name: 0 for f in dataclasses.fields(PoolStats)}
        self._probe_lock = asyncio.Lock()
        for m in self.members:
            self._push(m)

    @classmethod
    def from_urls(
        cls,
        urls: Sequence[str],
        *,
        kind: BackendKind = "reference",
        model: str | None = None,
        api_key: str | None = None,
        admin_key: str | None = None,
        timeout_s: float = 300.0,
        max_connections: int = 512,
        http_client: HttpClient = "http1",
        **kwargs: Any,
    ) -> BackendPool:
        """One CompletionBackend per URL (named by its URL), each with its own keep-alive
        ``httpx.AsyncClient`` sized for many concurrent streams. ``http_client`` is the client
        of the per-call POST (``ProxySettings.proxy_http_client``): ``http1`` puts the lean
        HTTP/1.1 transport (http1.py) under the httpx client too, and completions go over it
        without httpx; ``aiohttp`` sends completions with aiohttp's client; ``httpx`` sends
        everything through httpx (httpcore). ``api_key`` and ``admin_key``: the keys each backend
        sends (CompletionBackend)."""
        if http_client not in ("http1", "aiohttp", "httpx"):
            raise ProxyConfigError(f"unknown http_client {http_client!r}")
        backends: list[CompletionBackend] = []
        owned: list[_Closeable] = []
        for url in urls:
            timeout = httpx.Timeout(timeout_s, connect=min(5.0, timeout_s))
            lean: Http1Transport | AiohttpPost | None = None
            if http_client == "http1":
                lean = Http1Transport(max_connections=max_connections)
                http = httpx.AsyncClient(timeout=timeout, transport=lean)
            else:
                limits = httpx.Limits(
                    max_connections=max_connections, max_keepalive_connections=max_connections
                )
                http = httpx.AsyncClient(timeout=timeout, limits=limits)
                if http_client == "aiohttp":
                    lean = AiohttpPost(max_connections=max_connections)
                    owned.append(lean)
            owned.append(http)
            name = url.rstrip("/").removesuffix("/v1")
            backends.append(
                CompletionBackend(
                    url,
                    name,
                    kind=kind,
                    http=http,
                    model=model,
                    api_key=api_key,
                    lean=lean,
                    admin_key=admin_key,
                )
            )
        return cls(backends, owned_clients=owned, **kwargs)

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Probe every backend once (health + policy version), then keep probing."""
        await self.check_health()
        for m in self.members:
            if m.healthy:
                with contextlib.suppress(BackendError):
                    m.policy_version = await m.backend.policy_version()
        if self._health_task is None and self.health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop(), name="pool-health")

    async def aclose(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        for m in self.members:
            await m.backend.aclose()
        for client in self._clients:
            await client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # never let the loop die
                log.exception("backend health check failed")

    async def check_health(self) -> None:
        """Probe every backend; take out the dead ones, readmit the ones that answer again."""
        async with self._probe_lock:
            results = await asyncio.gather(*(m.backend.health() for m in self.members))
            for m, ok in zip(self.members, results, strict=True):
                if ok and not m.healthy:
                    await self._readmit(m)
                elif not ok and m.healthy:
                    self._mark_down(m, "health check failed")

    async def _readmit(self, m: Member) -> None:
        try:
            if self._target is not None:
                path, version = self._target
                current = await m.backend.policy_version()
                if current != version:
                    log.info("backend %s serves version %d; reloading %d", m.name, current, version)
                    current = await m.backend.reload_weights(path, version)
                m.policy_version = current
            else:
                m.policy_version = await m.backend.policy_version()
        except BackendError as exc:
            m.last_error = str(exc)
            return
        m.healthy, m.last_error = True, ""
        self._push(m)
        self._member_up.set()
        log.info("backend %s is back", m.name)

    def _mark_down(self, m: Member, reason: str) -> None:
        if m.healthy:
            log.warning("backend %s taken out: %s", m.name, reason)
        m.healthy, m.last_error = False, reason
        m.failures += 1
        m.stamp += 1  # its heap entries are now stale
        if not any(x.healthy for x in self.members):
            self._member_up.clear()

    # --- routing -----------------------------------------------------------------------------

    def _push(self, m: Member) -> None:
        m.stamp += 1
        if m.healthy:
            heapq.heappush(self._heap, (m.active, next(self._order), m.stamp, m))
        if len(self._heap) > 8 * len(self.members) + 64:  # drop stale entries now and then
            self._heap = [e for e in self._heap if e[2] == e[3].stamp and e[3].healthy]
            heapq.heapify(self._heap)

    def _least_loaded(self) -> Member | None:
        while self._heap:
            _, _, stamp, m = self._heap[0]
            if m.healthy and stamp == m.stamp:
                return m
            heapq.heappop(self._heap)
        return None

    def route(self, rollout_id: str) -> Member | None:
        """The backend for this rollout: its pinned one while healthy, else the least loaded
        (the rollout moves). None when no backend is healthy."""
        m = self._sticky.get(rollout_id)
        if m is not None:
            if m.healthy:
                return m
            m.active -= 1
            self._counts["moved"] += 1
            del self._sticky[rollout_id]
        m = self._least_loaded()
        if m is None:
            return None
        m.active += 1
        self._sticky[rollout_id] = m
        self._push(m)
        return m

    def release(self, rollout_id: str) -> None:
        """The rollout ended: free its slot on its backend."""
        m = self._sticky.pop(rollout_id, None)
        if m is not None:
            m.active -= 1
            self._push(m)

    def backend_of(self, rollout_id: str) -> str | None:
        m = self._sticky.get(rollout_id)
        return m.name if m is not None else None

    # --- calls -------------------------------------------------------------------------------

    async def _gate(self) -> None:
        if self._open.is_set():
            return
        self._counts["paused_waits"] += 1
        try:
            await asyncio.wait_for(self._open.wait(), self.pause_wait_s)
        except TimeoutError:
            self._counts["paused_rejects"] += 1
            raise PoolPaused(self.retry_after_s) from None

    async def complete(
        self, rollout_id: str, prompt_ids: np.ndarray | list[int], **params: Any
    ) -> Completion:
        """Sample a completion on the rollout's backend, failing over to another one when it
        is unavailable. ``params`` go to ``CompletionBackend.complete`` (max_tokens, ...).
        A generation cut by an interrupting weight update goes on under the new weights (the
        module docstring); the result then has ``parts``. ``latency_s`` covers every attempt
        (and the wait for such an update; not the wait at the pause gate before the first)."""
        await self._gate()
        self._inflight += 1
        self._idle.clear()
        started = time.perf_counter()
        try:
            parts: list[Completion] = []
            ids, kwargs = prompt_ids, params
            while True:
                epoch = self._epoch
                out = await self._complete_once(rollout_id, ids, kwargs)
                if out.finish_reason != "abort" or self._epoch == epoch:
                    break
                self._counts["interrupted"] += 1  # cut by an update: go on with the new weights
                if len(out.token_ids):
                    parts.append(out)
                ids, more = _continuation(prompt_ids, params, [p.token_ids for p in parts])
                if more is None:  # cut at its last token: it ends at the length limit
                    out = dataclasses.replace(parts.pop(), finish_reason="length")
                    break
                kwargs = more
                await self._gate()
            if parts:
                out = _joined([*parts, out], len(prompt_ids))
            return dataclasses.replace(out, latency_s=time.perf_counter() - started)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def _complete_once(
        self, rollout_id: str, prompt_ids: np.ndarray | list[int], params: dict[str, Any]
    ) -> Completion:
        """One completion on the rollout's backend, with failover (``complete``)."""
        deadline = time.monotonic() + self.backend_wait_s
        attempts = 0
        last: BackendError | None = None
        while True:
            m = await self._dispatch(rollout_id, deadline, last, attempts)
            attempts += 1
            try:
                out = await m.backend.complete(prompt_ids, **params)
            except BackendUnavailable as exc:
                last = exc
                self._failed_over(m, exc, attempts, deadline)
                continue
            finally:
                m.inflight -= 1
            m.policy_version = out.policy_version
            self._count_done(len(prompt_ids), len(out.token_ids))
            return out

    async def stream(
        self, rollout_id: str, prompt_ids: np.ndarray | list[int], **params: Any
    ) -> AsyncGenerator[TokenChunk, None]:
        """``complete`` streamed: the completion's token chunks as the rollout's backend sends
        them. Until the first chunk, an unavailable backend is replaced as in ``complete``;
        after it, a failure is raised (BackendError) and nothing is retried. Close the iterator
        to end the call early (the backend's connection is closed). A generation cut by an
        interrupting weight update goes on under the new weights: the chunk before the cut is
        marked ``part_end`` and the continuation's first chunk carries its policy version."""
        await self._gate()
        self._inflight += 1
        self._idle.clear()
        try:
            ids, kwargs = prompt_ids, params
            got: list[int] = []  # the tokens so far, for a continuation's prompt
            cont = False
            while True:
                epoch = self._epoch
                cut: TokenChunk | None = None
                chunks = self._stream_once(rollout_id, ids, kwargs)
                try:
                    async for chunk in chunks:
                        if chunk.finish_reason == "abort" and self._epoch != epoch:
                            cut = chunk
                            break
                        if cont:  # the first chunk under the new weights names them
                            cont = False
                            if chunk.policy_version is None:
                                chunk = dataclasses.replace(
                                    chunk, policy_version=self.policy_version
                                )
                        got += chunk.token_ids
                        yield chunk
                finally:
                    await chunks.aclose()
                if cut is None:
                    return
                self._counts["interrupted"] += 1
                got += cut.token_ids
                ids, more = _continuation(prompt_ids, params, [got])
                if more is None:  # cut at its last token: it ends at the length limit
                    yield dataclasses.replace(cut, finish_reason="length", stop_reason=None)
                    return
                yield dataclasses.replace(cut, finish_reason=None, stop_reason=None, part_end=True)
                kwargs, cont = more, True
                await self._gate()
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def _stream_once(
        self, rollout_id: str, prompt_ids: np.ndarray | list[int], params: dict[str, Any]
    ) -> AsyncGenerator[TokenChunk, None]:
        """One streamed completion on the rollout's backend, with failover before its first
        chunk (``stream``)."""
        deadline = time.monotonic() + self.backend_wait_s
        attempts = 0
        last: BackendError | None = None
        while True:
            m = await self._dispatch(rollout_id, deadline, last, attempts)
            attempts += 1
            chunks = m.backend.stream(prompt_ids, **params)
            try:
                try:
                    first = await anext(chunks)
                except StopAsyncIteration:  # the backend raises rather than end early
                    msg = "the stream ended without a token"
                    raise BackendUnavailable(msg, backend=m.name) from None
                except BackendUnavailable as exc:
                    last = exc
                    self._failed_over(m, exc, attempts, deadline)
                    continue
                if first.policy_version is not None:
                    m.policy_version = first.policy_version
                n = len(first.token_ids)
                if first.finish_reason is not None:
                    self._count_done(len(prompt_ids), n)
                yield first
                try:
                    async for chunk in chunks:
                        n += len(chunk.token_ids)
                        if chunk.finish_reason is not None:  # counted before the caller
                            self._count_done(len(prompt_ids), n)  # may stop reading
                        yield chunk
                except BackendUnavailable as exc:
                    self._mark_down(m, str(exc))
                    raise
                return
            finally:
                m.inflight -= 1
                await chunks.aclose()

    async def _dispatch(
        self, rollout_id: str, deadline: float, last: BackendError | None, attempts: int
    ) -> Member:
        """The rollout's backend for the next attempt (waiting while none is up, until
        ``deadline``), counted as dispatched (a failover after the first attempt), its
        ``inflight`` taken: the caller gives it back."""
        while (m := self.route(rollout_id)) is None:
            await self._wait_for_member(deadline, last)
        if attempts:
            self._counts["failovers"] += 1
        m.inflight += 1
        m.calls += 1
        self._counts["dispatched"] += 1
        return m

    def _failed_over(
        self, m: Member, exc: BackendUnavailable, attempts: int, deadline: float
    ) -> None:
        """``m`` failed an attempt: it is marked down; NoBackendAvailable once the attempts
        or the time are used up (the caller tries the next backend otherwise)."""
        self._mark_down(m, str(exc))
        if attempts > 4 * len(self.members) or time.monotonic() > deadline:
            raise NoBackendAvailable(f"backend call failed: {exc}", exc) from exc

    def _count_done(self, prompt_tokens: int, completion_tokens: int) -> None:
        self._counts["completed"] += 1
        self._counts["prompt_tokens"] += prompt_tokens
        self._counts["completion_tokens"] += completion_tokens

    async def _wait_for_member(self, deadline: float, last: BackendError | None) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            reasons = "; ".join(f"{m.name}: {m.last_error or 'down'}" for m in self.members)
            raise NoBackendAvailable(f"no healthy backend ({reasons})", last)
        self._member_up.clear()
        # probe now rather than waiting for the loop: the backend may just have restarted
        await self.check_health()
        if any(m.healthy for m in self.members):
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._member_up.wait(), min(left, self.health_interval_s))

    # --- pause / drain / resume ----------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @property
    def inflight(self) -> int:
        return self._inflight

    def pause(self) -> None:
        """New calls wait at the gate (up to ``pause_wait_s``); calls in flight go on."""
        self._open.clear()

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until no call is in flight; False if ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout or self.drain_timeout_s)
        except TimeoutError:
            return False
        return True

    def resume(self) -> None:
        self._open.set()

    async def update_weights(
        self, path: str, version: int, mode: WeightUpdateMode | None = None
    ) -> dict[str, Any]:
        """Pause -> drain (``mode`` drain) or cut the generations in flight (interrupt) ->
        reload every healthy backend (in parallel) -> resume; ``mode`` None: the pool's
        ``weight_update_mode``. A backend that fails to pause or reload is taken out and
        reloaded by the health loop before it serves again. Raises PoolError when the drain
        times out or no backend could reload."""
        mode = mode or self.weight_update_mode
        if mode not in ("drain", "interrupt"):
            raise PoolError(f"unknown weight update mode {mode!r}")
        async with self._update_lock:
            self.pause()
            paused: list[Member] = []
            try:
                t0 = time.perf_counter()
                if mode == "interrupt":
                    paused = await self._interrupt()
                elif not await self.drain():
                    raise PoolError(f"drain timed out with {self._inflight} calls in flight")
                drained = time.perf_counter() - t0
                live = [m for m in self.members if m.healthy]
                results = await asyncio.gather(
                    *(m.backend.reload_weights(path, version) for m in live),
                    return_exceptions=True,
                )
                failed = {m.name: str(r) for m, r in zip(live, results, strict=True)
                          if isinstance(r, BaseException)}  # fmt: skip
                if live and len(failed) == len(live):
                    # no backend loaded it (a bad path): they all still serve what they served,
                    # so none is taken out and the target stays the last good one
                    raise PoolError(f"no backend could load {path}: {failed}")
                self._target = (path, version)
                for m, r in zip(live, results, strict=True):
                    if isinstance(r, BaseException):  # the health loop reloads it to the target
                        self._mark_down(m, f"reload failed: {r}")
                    else:
                        m.policy_version = int(r)
                self._counts["weight_updates"] += 1
                return {
                    "policy_version": version, "mode": mode,
                    "reloaded": len(live) - len(failed), "failed": failed,
                    "drain_s": round(drained, 4), "total_s": round(time.perf_counter() - t0, 4),
                }  # fmt: skip
            finally:
                await self._resume_backends(paused)
                self.resume()

    async def _interrupt(self) -> list[Member]:
        """Cut the generations in flight: every healthy backend pauses with ``mode=abort``
        (answering once its running batch has ended). Returns the backends paused; one that
        fails is taken out (the health loop brings it back on the new weights)."""
        self._epoch += 1
        live = [m for m in self.members if m.healthy]
        results = await asyncio.gather(
            *(m.backend.pause("abort") for m in live), return_exceptions=True
        )
        paused = []
        for m, r in zip(live, results, strict=True):
            if isinstance(r, BaseException):
                self._mark_down(m, f"pause for a weight update failed: {r}")
            else:
                paused.append(m)
        return paused

    async def _resume_backends(self, paused: list[Member]) -> None:
        results = await asyncio.gather(
            *(m.backend.resume() for m in paused), return_exceptions=True
        )
        for m, r in zip(paused, results, strict=True):
            if isinstance(r, BaseException):
                self._mark_down(m, f"resume after a weight update failed: {r}")

    # --- introspection -----------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The version the pool serves (the last update's, else the highest reported)."""
        if self._target is not None:
            return self._target[1]
        return max((m.policy_version for m in self.members), default=0)

    @property
    def guided_decoding(self) -> bool:
        """Whether every backend decodes under a grammar (vLLM: ``response_format``), so a
        call may ask for JSON whichever backend it lands on after a failover."""
        return bool(self.members) and all(m.backend.kind == "vllm" for m in self.members)

    @property
    def stats(self) -> PoolStats:
        return PoolStats(**self._counts)

    def status(self) -> dict[str, Any]:
        return {
            "paused": self.paused, "inflight": self._inflight,
            "policy_version": self.policy_version, "rollouts": len(self._sticky),
            "backends": [m.status() for m in self.members],
            "stats": dataclasses.asdict(self.stats),
        }  # fmt: skip


def _continuation(
    prompt_ids: np.ndarray | list[int], params: dict[str, Any], tokens: list[Any]
) -> tuple[np.ndarray, dict[str, Any] | None]:
    """The request that goes on with a generation cut after ``tokens`` (arrays or lists of
    ids): the prompt extended by them, ``max_tokens`` reduced by them; params None when no
    token is left to generate."""
    ids = np.concatenate([np.asarray(prompt_ids, dtype=np.uint32),
                          *(np.asarray(t, dtype=np.uint32) for t in tokens)])  # fmt: skip
    limit = params.get("max_tokens")
    if limit is None:
        return ids, params
    left = limit - (len(ids) - len(prompt_ids))
    return ids, ({**params, "max_tokens": left} if left > 0 else None)


def _joined(pieces: list[Completion], prompt_tokens: int) -> Completion:
    """One completion from the pieces of a generation cut by interrupting weight updates
    (each piece but the last ended "abort"); ``parts`` names each piece's tokens' version."""
    last = pieces[-1]
    parts = tuple((len(p.token_ids), p.policy_version) for p in pieces if len(p.token_ids))
    tops = None
    if all(p.top_logprobs is not None for p in pieces):
        tops = [step for p in pieces for step in p.top_logprobs or []]
    return Completion(
        token_ids=np.concatenate([p.token_ids for p in pieces]).astype(np.uint32, copy=False),
        logprobs=np.concatenate([p.logprobs for p in pieces]).astype(np.float32, copy=False),
        finish_reason=last.finish_reason,
        policy_version=parts[-1][1] if parts else last.policy_version,
        prompt_tokens=prompt_tokens,
        stop_reason=last.stop_reason,
        top_logprobs=tops,
        backend=last.backend,
        model=last.model,
        parts=parts if len(parts) > 1 else (),
    )
