"""Inference backends as the proxy sees them: token ids in, token ids and logprobs out.

``CompletionBackend`` talks to the rollstream reference server (kind="reference") or to a vLLM
OpenAI server (kind="vllm") with the same request: ``POST /v1/completions`` with ``prompt`` as
token ids, ``return_token_ids=true`` (vLLM >= 0.10.2 answers ``choices[0].token_ids``) and
``logprobs=0`` + ``return_tokens_as_token_ids=true`` (``choices[0].logprobs.token_logprobs``;
``tokens`` as "token_id:N", used when ``token_ids`` is absent). ``logprobs=k`` (k <= 20) adds
each step's top-k alternatives (``top_logprobs``, keys "token_id:N"; both servers add the sampled
token to them, which ``Completion.top_logprobs`` leaves out unless it is in the top k). A
``response_format`` (json_object / json_schema) is passed on to vLLM, which decodes under its
grammar; the reference server has no guided decoding, so ``complete`` refuses one for it
(BackendRejected, before any request). They differ in weight updates:

- reference: ``POST /v1/load_weights {"path", "version"}``, applied between two batches, and
  ``GET /v1/policy_version``; every completion reports the version that generated it.
- vllm: the dev-mode RL routes of ``vllm serve`` (``VLLM_SERVER_DEV_MODE=1``):
  ``POST /pause?mode=wait``, ``POST /collective_rpc {"method": "reload_weights", "kwargs":
  {"weights_path": path}}``, ``POST /update_weight_version {"new_version": "N"}``,
  ``POST /resume``; the version is read with ``GET /weight_info``. vLLM's completions do not
  carry the version, so the adapter reports the last version it set or read.

``stream(...)`` is the same call with ``stream: true``: an async iterator of TokenChunk
(streaming.py) as the backend samples them, in vLLM's streamed ``text_completion`` chunks
(the reference server sends the same). Errors before the first chunk are the ones
``complete`` raises (the pool fails over on BackendUnavailable); a stream that breaks later
raises BackendUnavailable (cut off, an error event) or BackendProtocolError (a chunk without
the fields we need) from the iterator. Closing the iterator early closes the connection, so
the backend ends the request (vLLM aborts a request whose client went away; so does the
reference server).

The per-call ``POST /v1/completions`` goes over one of three HTTP clients
(``ProxySettings.proxy_http_client``): our lean HTTP/1.1 client (``lean=Http1Transport``, the
default and the fastest), aiohttp's (``lean=AiohttpPost``) or httpx's own; every other request
(health, versions, weight updates) goes through the httpx client ``http``.

Errors (producers/errors.py), each a ProxyError under ProducerError; ``complete`` raises only
these::

    BackendError                 a backend call failed (.backend, .status)
    ├── BackendUnavailable       connection error, timeout, 5xx or a malformed HTTP answer: the
    │                            pool tries another backend
    ├── BackendRejected          4xx: this request is wrong; retrying it will not help
    └── BackendProtocolError     a 2xx answer without the fields we need
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
import numpy as np

from rollstream.producers.errors import (
    BackendError,
    BackendProtocolError,
    BackendRejected,
    BackendUnavailable,
    Http1Error,
    ProxyConfigError,
)
from rollstream.producers.proxy.http1 import Http1Transport
from rollstream.producers.proxy.streaming import (
    SseParser,
    TokenChunk,
    merge_chunks,
    parse_chunk,
)
from rollstream.schemas.events import policy_version_problem

try:
    import orjson

    _dumps: Any = orjson.dumps
    _loads: Any = orjson.loads
except ImportError:  # pragma: no cover - orjson is a dependency
    import json

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    _loads = json.loads

__all__ = [
    "AiohttpPost",
    "BackendError",
    "BackendKind",
    "BackendProtocolError",
    "BackendRejected",
    "BackendUnavailable",
    "Completion",
    "CompletionBackend",
    "TokenChunk",
]

MAX_ERROR_BYTES = 64 * 1024  # of an error answer to a streamed request

BackendKind = Literal["reference", "vllm"]


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled completion. ``logprobs[i]`` is the behaviour policy's logprob of
    ``token_ids[i]`` (see docs/model-server.md for which distribution)."""

    token_ids: np.ndarray  # (N,) uint32
    logprobs: np.ndarray  # (N,) float32
    finish_reason: str  # stop | length | abort
    policy_version: int
    prompt_tokens: int
    stop_reason: int | None = None  # the stop_token_ids entry that ended it; None for EOS
    # per generated token, the top-k (token id, logprob), best first; None unless asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None
    backend: str = ""
    model: str = ""
    latency_s: float = 0.0
    # a completion generated across interrupting weight updates (BackendPool, interrupt mode):
    # (token count, policy version) of each part, in order; empty: one part, ``policy_version``
    parts: tuple[tuple[int, int], ...] = ()


def _error_message(response: httpx.Response | bytes) -> str:
    raw = response if isinstance(response, bytes) else response.content
    try:
        body = _loads(raw)
    except ValueError:
        return raw[:500].decode("utf-8", "replace")
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(body.get("detail"), str):  # FastAPI's HTTPException (vLLM dev routes)
            return str(body["detail"])
    return str(body)[:500]


def _token_id(t: Any) -> int:
    if not isinstance(t, str) or not t.startswith("token_id:"):
        raise ValueError(f"logprobs token {t!r} is not of the form 'token_id:N'")
    return int(t.removeprefix("token_id:"))


def _token_ids_from_logprobs(tokens: list[Any]) -> list[int]:
    return [_token_id(t) for t in tokens]


def _top_logprobs(steps: Any, k: int, n: int) -> list[list[tuple[int, float]]]:
    """The top ``k`` (token id, logprob) of each of ``n`` steps, best first, from the
    completions API's ``top_logprobs`` (one ``{"token_id:N": logprob}`` dict per step)."""
    if not isinstance(steps, list) or len(steps) != n:
        raise ValueError(f"top_logprobs for {n} tokens expected, got {steps!s:.80}")
    out = []
    for step in steps:
        if not isinstance(step, dict):
            raise ValueError(f"a top_logprobs step is not an object: {step!s:.80}")
        pairs = [(_token_id(t), float(v)) for t, v in step.items() if v is not None]
        pairs.sort(key=lambda p: -p[1])
        out.append(pairs[:k])
    return out


async def _httpx_parts(response: httpx.Response) -> AsyncIterator[bytes]:
    async for part in response.aiter_bytes():
        yield part


class AiohttpPost:
    """The per-call POST over aiohttp's client (``proxy_http_client="aiohttp"``): one
    keep-alive session, made in the event loop of the first call. Needs ``aiohttp``."""

    def __init__(self, *, max_connections: int = 512) -> None:
        try:
            import aiohttp
        except ImportError as exc:
            msg = "proxy_http_client=aiohttp needs aiohttp (pip install aiohttp)"
            raise ProxyConfigError(msg) from exc
        self._aiohttp = aiohttp
        self._max_connections = max_connections
        self._session: Any = None

    async def post(
        self, url: str, headers: dict[str, str], payload: bytes, timeouts: dict[str, Any]
    ) -> tuple[int, bytes]:
        """(status, body) of ``POST url``; BackendUnavailable when the exchange fails."""
        aiohttp = self._aiohttp
        if self._session is None:
            timeout = aiohttp.ClientTimeout(
                total=None, connect=timeouts.get("connect"), sock_read=timeouts.get("read")
            )
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                timeout=timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        try:
            async with self._session.post(url, data=payload, headers=headers) as response:
                return response.status, await response.read()
        except TimeoutError as exc:
            raise BackendUnavailable(f"timed out: {exc!r}") from exc
        except aiohttp.ClientError as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc

    @contextlib.asynccontextmanager
    async def stream(
        self, url: str, headers: dict[str, str], payload: bytes, timeouts: dict[str, Any]
    ) -> AsyncIterator[tuple[int, str, AsyncIterator[bytes]]]:
        """(status, content type, body parts as they arrive) of ``POST url``;
        BackendUnavailable when the exchange fails, also while the parts are read. Leaving
        early closes the connection."""
        aiohttp = self._aiohttp
        await self.post_session(timeouts)

        async def parts(response: Any) -> AsyncIterator[bytes]:
            try:
                async for part in response.content.iter_any():
                    yield part
            except TimeoutError as exc:
                raise BackendUnavailable(f"timed out: {exc!r}") from exc
            except aiohttp.ClientError as exc:
                raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc

        try:
            response = await self._session.post(url, data=payload, headers=headers)
        except TimeoutError as exc:
            raise BackendUnavailable(f"timed out: {exc!r}") from exc
        except aiohttp.ClientError as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc
        done = False
        try:
            yield response.status, response.headers.get("Content-Type", ""), parts(response)
            done = True
        finally:
            if done and response.content.at_eof():
                response.release()
            else:
                response.close()  # the connection is not reused: the backend sees it go

    async def post_session(self, timeouts: dict[str, Any]) -> None:
        aiohttp = self._aiohttp
        if self._session is None:
            timeout = aiohttp.ClientTimeout(
                total=None, connect=timeouts.get("connect"), sock_read=timeouts.get("read")
            )
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                timeout=timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
            )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


@dataclass(frozen=True, slots=True)
class _Target:
    """POST /v1/completions of one base URL, ready for the lean clients."""

    host: str
    port: int
    head: bytes  # the request head up to Content-Length (Http1Transport)
    url: str
    headers: dict[str, str]  # the same headers (AiohttpPost)
    timeouts: dict[str, Any]


class CompletionBackend:
    """Async client for one inference server. ``base_url`` is the server root
    (``http://host:port``; a trailing ``/v1`` is accepted). Pass ``http`` to share a client
    (it is then not closed by ``aclose``). Pass ``lean`` (the Http1Transport under that
    client, another one, or an AiohttpPost) and ``complete`` skips httpx: its POST goes over
    ``lean``'s pooled connections, orjson both ways (http:// base URLs only; the caller closes
    ``lean``). ``api_key`` is sent as a bearer key on every request but the weight and control
    ones (pause, resume, load_weights, collective_rpc, update_weight_version), which send
    ``admin_key`` (the model server's admin key; unset: ``api_key``)."""

    def __init__(
        self,
        base_url: str,
        name: str,
        *,
        kind: BackendKind = "reference",
        http: httpx.AsyncClient | None = None,
        model: str | None = None,
        timeout_s: float = 300.0,
        api_key: str | None = None,
        lean: Http1Transport | AiohttpPost | None = None,
        admin_key: str | None = None,
    ) -> None:
        if kind not in ("reference", "vllm"):
            raise ProxyConfigError(f"unknown backend kind {kind!r}")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.name, self.kind, self.model = name, kind, model
        self._own_http = http is None
        self._http = http or httpx.AsyncClient(timeout=timeout_s)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # the weight and control routes' key (the model server's admin key); unset: api_key
        self._admin_headers = (
            {"Authorization": f"Bearer {admin_key}"} if admin_key else self._headers
        )
        self._version = 0
        self._paused_by_caller = False
        self._lean_transport = lean
        self._api_key = api_key
        self._lean_url = ""  # the base_url _lean was made for (base_url may be reassigned)
        self._lean: _Target | None = None

    async def __aenter__(self) -> CompletionBackend:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own_http:
            await self._http.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        admin: bool = False,
    ) -> httpx.Response:
        """``method path`` with the backend key, or with the admin key on a weight or control
        route (``admin``)."""
        url = f"{self.base_url}{path}"
        headers = self._admin_headers if admin else self._headers
        try:
            response = await self._http.request(
                method, url, json=json, params=params, headers=headers
            )
        except httpx.TransportError as exc:  # connect, read, write, pool, timeout
            raise BackendUnavailable(f"{method} {path}: {exc!r}", backend=self.name) from exc
        if response.status_code >= 500:
            msg = f"{method} {path}: HTTP {response.status_code}: {_error_message(response)}"
            raise BackendUnavailable(msg, backend=self.name, status=response.status_code)
        if response.status_code >= 400:
            msg = f"{method} {path}: HTTP {response.status_code}: {_error_message(response)}"
            raise BackendRejected(msg, backend=self.name, status=response.status_code)
        return response

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self._request(method, path, **kwargs)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise BackendProtocolError(f"{path}: invalid JSON", backend=self.name) from exc

    async def complete(
        self,
        prompt_ids: list[int] | np.ndarray,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        top_logprobs: int = 0,
        response_format: dict[str, Any] | None = None,
    ) -> Completion:
        """Sample one completion of ``prompt_ids``; the stop token, if any, is included.
        ``top_logprobs`` > 0 also asks for that many alternatives per token;
        ``response_format`` (vLLM only) constrains the completion to JSON."""
        body = self._body(
            prompt_ids, max_tokens, temperature, top_p, seed, stop_token_ids, top_logprobs,
            response_format,
        )  # fmt: skip
        started = time.perf_counter()
        if self._lean_transport is not None and self._lean_target() is not None:
            data = await self._post_lean(body)
        else:
            data = await self._json("POST", "/v1/completions", json=body)
        latency = time.perf_counter() - started
        try:
            return self._parse(data, len(body["prompt"]), latency, top_logprobs)
        except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
            # OverflowError: a token id outside uint32 (numpy refuses it)
            raise BackendProtocolError(f"bad completion body: {exc}", backend=self.name) from exc

    def _body(
        self,
        prompt_ids: list[int] | np.ndarray,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        stop_token_ids: list[int] | None,
        top_logprobs: int,
        response_format: dict[str, Any] | None,
    ) -> dict[str, Any]:
        if response_format is not None and self.kind != "vllm":
            msg = "response_format needs a backend with guided decoding (kind vllm)"
            raise BackendRejected(msg, backend=self.name, status=400)
        if isinstance(prompt_ids, np.ndarray):
            prompt = prompt_ids.astype(np.int64, copy=False).tolist()  # Python ints
        else:
            prompt = [int(t) for t in prompt_ids]
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": int(top_logprobs),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "n": 1,
        }
        if self.model is not None:
            body["model"] = self.model
        if seed is not None:
            body["seed"] = seed
        if stop_token_ids:
            body["stop_token_ids"] = [int(t) for t in stop_token_ids]
        if response_format is not None:
            body["response_format"] = response_format
        return body

    async def stream(
        self,
        prompt_ids: list[int] | np.ndarray,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        top_logprobs: int = 0,
        response_format: dict[str, Any] | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """``complete`` streamed: the completion's tokens as the backend samples them (see the
        module docstring for the errors). The last chunk carries the finish reason."""
        body = self._body(
            prompt_ids, max_tokens, temperature, top_p, seed, stop_token_ids, top_logprobs,
            response_format,
        )  # fmt: skip
        body["stream"] = True
        where = "POST /v1/completions (stream)"
        started = time.perf_counter()
        async with self._open_stream(body) as (status, content_type, parts):
            if status >= 400 or not content_type.startswith("text/event-stream"):
                content = b""
                async for part in parts:
                    content += part
                    if status >= 400 and len(content) > MAX_ERROR_BYTES:
                        break
                if status >= 400:
                    msg = f"{where}: HTTP {status}: {_error_message(content)}"
                    kind = BackendUnavailable if status >= 500 else BackendRejected
                    raise kind(msg, backend=self.name, status=status)
                # a backend that answers a streamed request whole: one chunk of every token
                yield self._whole(content, len(body["prompt"]), started, top_logprobs)
                return
            sse = SseParser()
            finished = first = False
            async for part in parts:
                try:
                    events = sse.feed(part)
                except ValueError as exc:
                    raise BackendProtocolError(f"{where}: {exc}", backend=self.name) from exc
                got: list[TokenChunk] = []  # the chunks of one read go on as one
                done = False
                for data in events:
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = self._chunk(data, top_logprobs, where)
                    if chunk is not None:
                        got.append(chunk)
                if got:
                    chunk = merge_chunks(got)
                    if chunk.policy_version is not None:
                        self._version = chunk.policy_version
                    if not first:  # the first chunk names the backend and the version
                        first = True
                        version = self._version
                        chunk = dataclasses.replace(
                            chunk, backend=self.name, policy_version=version
                        )
                    finished = chunk.finish_reason is not None
                    yield chunk
                if done:
                    if not finished:
                        msg = f"{where}: the stream ended before the last token"
                        raise BackendUnavailable(msg, backend=self.name)
                    async for _ in parts:  # the body's end: the connection is reusable
                        pass
                    return
            if not finished:
                msg = f"{where}: the stream was cut off before the last token"
                raise BackendUnavailable(msg, backend=self.name)

    def _whole(self, content: bytes, prompt_len: int, started: float, top_k: int) -> TokenChunk:
        try:
            out = self._parse(_loads(content), prompt_len, time.perf_counter() - started, top_k)
        except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
            raise BackendProtocolError(f"bad completion body: {exc}", backend=self.name) from exc
        return TokenChunk(
            token_ids=out.token_ids.tolist(),
            logprobs=out.logprobs.tolist(),
            top_logprobs=out.top_logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            policy_version=out.policy_version,
            model=out.model,
            backend=self.name,
        )

    def _chunk(self, data: bytes, top_k: int, where: str) -> TokenChunk | None:
        try:
            obj = _loads(data)
        except ValueError as exc:
            raise BackendProtocolError(f"{where}: invalid JSON", backend=self.name) from exc
        if isinstance(obj, dict) and "error" in obj:  # the backend failed mid-stream
            err = obj["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            raise BackendUnavailable(f"{where}: {str(msg)[:500]}", backend=self.name)
        try:
            return parse_chunk(obj, top_k)
        except ValueError as exc:
            raise BackendProtocolError(f"{where}: {exc}", backend=self.name) from exc

    @contextlib.asynccontextmanager
    async def _open_stream(
        self, body: dict[str, Any]
    ) -> AsyncIterator[tuple[int, str, AsyncIterator[bytes]]]:
        """(status, content type, body parts) of the streamed POST over the per-call client;
        every failure of the exchange, also while the parts are read, a BackendUnavailable."""
        where = "POST /v1/completions (stream)"
        lean = self._lean_transport
        target = self._lean_target() if lean is not None else None
        try:
            if target is not None and isinstance(lean, Http1Transport):
                payload = _dumps(body)
                head = target.head + b"Content-Length: %d\r\n\r\n" % len(payload)
                async with lean.stream(
                    target.host, target.port, head, payload, target.timeouts
                ) as (status, headers, parts):
                    kind = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                    yield status, kind.decode("latin-1"), parts
            elif target is not None and isinstance(lean, AiohttpPost):
                payload = _dumps(body)
                async with lean.stream(target.url, target.headers, payload, target.timeouts) as (
                    status,
                    kind,
                    parts,
                ):
                    yield status, kind, parts
            else:
                url = f"{self.base_url}/v1/completions"
                async with self._http.stream("POST", url, json=body, headers=self._headers) as r:
                    yield r.status_code, r.headers.get("content-type", ""), _httpx_parts(r)
        except Http1Error as exc:  # connect, read, write, pool, timeout, malformed answer
            raise BackendUnavailable(f"{where}: {exc.kind}: {exc}", backend=self.name) from exc
        except httpx.TransportError as exc:
            raise BackendUnavailable(f"{where}: {exc!r}", backend=self.name) from exc
        except BackendUnavailable as exc:
            if exc.backend:
                raise
            raise BackendUnavailable(f"{where}: {exc}", backend=self.name) from exc

    def _lean_target(self) -> _Target | None:
        """POST /v1/completions of the base URL for the lean path; None for a base URL it does
        not serve (not http://)."""
        if self._lean_url != self.base_url:
            self._lean_url, self._lean = self.base_url, None
            url = urlsplit(self.base_url)
            if url.scheme == "http" and url.hostname:
                t = self._http.timeout
                timeouts = {"connect": t.connect, "read": t.read, "write": t.write, "pool": t.pool}
                headers = {"Accept": "application/json", "Content-Type": "application/json"}
                if self._api_key:
                    headers["Authorization"] = f"Bearer {self._api_key}"
                lines = [f"POST {url.path}/v1/completions HTTP/1.1", f"Host: {url.netloc}"]
                lines += [f"{k}: {v}" for k, v in headers.items()]
                head = ("\r\n".join(lines) + "\r\n").encode("latin-1")
                target = f"{self.base_url}/v1/completions"
                port = url.port or 80
                self._lean = _Target(url.hostname, port, head, target, headers, timeouts)
        return self._lean

    async def _post_lean(self, body: dict[str, Any]) -> Any:
        """POST /v1/completions without httpx; the same errors as ``_json``."""
        target, lean = self._lean, self._lean_transport
        assert target is not None and lean is not None
        payload = _dumps(body)
        try:
            if isinstance(lean, Http1Transport):
                head = target.head + b"Content-Length: %d\r\n\r\n" % len(payload)
                status, _, content = await lean.exchange(
                    target.host, target.port, head, payload, target.timeouts
                )
            else:
                status, content = await lean.post(
                    target.url, target.headers, payload, target.timeouts
                )
        except Http1Error as exc:  # connect, read, write, pool, timeout, malformed answer
            msg = f"POST /v1/completions: {exc.kind}: {exc}"
            raise BackendUnavailable(msg, backend=self.name) from exc
        except BackendUnavailable as exc:
            raise BackendUnavailable(f"POST /v1/completions: {exc}", backend=self.name) from exc
        if status >= 400:
            msg = f"POST /v1/completions: HTTP {status}: {_error_message(content)}"
            kind = BackendUnavailable if status >= 500 else BackendRejected
            raise kind(msg, backend=self.name, status=status)
        if not content:
            return None
        try:
            return _loads(content)
        except ValueError as exc:
            raise BackendProtocolError("/v1/completions: invalid JSON", backend=self.name) from exc

    def _parse(
        self, data: dict[str, Any], prompt_len: int, latency: float, top_k: int = 0
    ) -> Completion:
        choice = data["choices"][0]
        lp = choice.get("logprobs") or {}
        logprobs = lp.get("token_logprobs")
        ids = choice.get("token_ids")
        if ids is None:  # vLLM < 0.10.2: only the logprobs tokens carry the ids
            ids = _token_ids_from_logprobs(lp.get("tokens") or [])
        if logprobs is None or len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} token ids but logprobs {logprobs!r:.80}")
        if any(v is None for v in logprobs):
            raise ValueError("a generated token has no logprob")
        version = data.get("policy_version")  # rollstream extension; vLLM does not send it
        if version is not None and (problem := policy_version_problem(version)) is not None:
            raise ValueError(f"policy_version {problem}")
        if isinstance(version, int):
            self._version = version
        usage = data.get("usage") or {}
        tops = _top_logprobs(lp.get("top_logprobs"), top_k, len(ids)) if top_k else None
        return Completion(
            token_ids=np.asarray(ids, dtype=np.uint32),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            finish_reason=str(choice.get("finish_reason") or "length"),
            policy_version=version if isinstance(version, int) else self._version,
            prompt_tokens=int(usage.get("prompt_tokens", prompt_len)),
            stop_reason=choice.get("stop_reason")
            if isinstance(choice.get("stop_reason"), int)
            else None,
            top_logprobs=tops,
            backend=self.name,
            model=str(data.get("model", self.model or "")),
            latency_s=latency,
        )

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200; never raises."""
        try:
            response = await self._http.get(f"{self.base_url}/health", headers=self._headers)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def policy_version(self) -> int:
        """The policy version the backend serves now."""
        if self.kind == "reference":
            data = await self._json("GET", "/v1/policy_version")
            self._version = int(data["policy_version"])
        else:
            data = await self._json("GET", "/weight_info")
            raw = (data or {}).get("weight_version")
            try:
                self._version = int(raw) if raw is not None else 0
            except (TypeError, ValueError) as exc:
                msg = f"weight_version {raw!r} is not an integer"
                raise BackendProtocolError(msg, backend=self.name) from exc
        return self._version

    async def pause(self, mode: Literal["abort", "wait", "keep"] = "wait") -> None:
        """Stop starting new generations (vLLM's ``POST /pause``); ``wait`` drains in-flight
        ones first, ``abort`` ends them early with finish_reason "abort". vLLM releases that
        name the choice ``wait_for_inflight_requests`` (false: abort) get it too."""
        params = {"mode": mode, "wait_for_inflight_requests": "true" if mode == "wait" else "false"}
        await self._request("POST", "/pause", params=params, admin=True)
        self._paused_by_caller = True

    async def resume(self) -> None:
        await self._request("POST", "/resume", admin=True)
        self._paused_by_caller = False

    async def reload_weights(self, path: str, version: int) -> int:
        """Load the weights at ``path`` (a checkpoint directory or a state-dict file, as seen
        by the server) and make ``version`` the served policy version. Returns it."""
        if self.kind == "reference":
            data = await self._json(
                "POST", "/v1/load_weights", json={"path": path, "version": version}, admin=True
            )
            served = data.get("policy_version")
            if (problem := policy_version_problem(served)) is not None:
                raise BackendProtocolError(
                    f"/v1/load_weights: policy_version {problem}", backend=self.name
                )
            self._version = int(served)
            return self._version
        paused_here = not self._paused_by_caller
        if paused_here:
            params = {"mode": "wait", "wait_for_inflight_requests": "true"}
            await self._request("POST", "/pause", params=params, admin=True)
        try:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": path}}
            await self._request("POST", "/collective_rpc", json=rpc, admin=True)
            await self._request(
                "POST", "/update_weight_version", json={"new_version": str(version)}, admin=True
            )
        except BaseException:
            if paused_here:  # resume anyway; the reload error is the one to report
                with contextlib.suppress(BackendError):
                    await self._request("POST", "/resume", admin=True)
            raise
        if paused_here:
            await self._request("POST", "/resume", admin=True)
        self._version = version
        return version
