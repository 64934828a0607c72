"""The backend adapter at its I/O edge: an in-memory httpx transport plays the server, so the
exact requests sent and every answer shape (including vLLM's) are checked without a network.
The real round trip against the reference server is in test_model_server.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

from rollstream.producers.proxy.backends import (
    BackendError,
    BackendProtocolError,
    BackendRejected,
    BackendUnavailable,
    CompletionBackend,
)

Handler = Callable[[httpx.Request], httpx.Response]


class Recorder:
    """A fake server: answers by route and records (method, path, query, json) per call."""

    def __init__(self, routes: dict[str, Handler | dict[str, Any]]) -> None:
        self.routes, self.calls = routes, []  # type: ignore[var-annotated]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.calls.append((request.method, request.url.path, dict(request.url.params), body))
        answer = self.routes.get(request.url.path)
        if answer is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        return answer(request) if callable(answer) else httpx.Response(200, json=answer)

    def paths(self) -> list[str]:
        return [c[1] for c in self.calls]


def backend(rec: Recorder, kind: str = "vllm", **kw: Any) -> CompletionBackend:
    http = httpx.AsyncClient(transport=httpx.MockTransport(rec))
    return CompletionBackend("http://vllm:8000/v1/", "b0", kind=kind, http=http, **kw)  # type: ignore[arg-type]


def vllm_completion(ids: list[int], logprobs: list[float], *, with_ids: bool = True) -> dict:  # type: ignore[type-arg]
    """A response as vLLM's OpenAIServingCompletion writes it (no policy_version field)."""
    return {
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "Qwen/Qwen3-0.6B",
        "choices": [{
            "index": 0, "text": "...", "finish_reason": "stop", "stop_reason": None,
            "token_ids": ids if with_ids else None, "prompt_token_ids": [1, 2, 3],
            "logprobs": {"text_offset": [0] * len(ids), "token_logprobs": logprobs,
                         "tokens": [f"token_id:{t}" for t in ids],
                         "top_logprobs": [{f"token_id:{t}": v}
                                          for t, v in zip(ids, logprobs, strict=True)]},
        }],
        "usage": {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids)},
    }  # fmt: skip


def test_complete_sends_vllms_token_id_request() -> None:
    rec = Recorder({"/v1/completions": vllm_completion([5, 6, 151645], [-0.5, -1.0, -0.1])})

    async def main() -> Any:
        async with backend(rec, model="Qwen/Qwen3-0.6B") as b:
            return await b.complete(
                np.array([1, 2, 3], dtype=np.uint32), max_tokens=8, temperature=0.7,
                top_p=0.9, seed=42, stop_token_ids=[151645],
            )  # fmt: skip

    c = asyncio.run(main())
    method, path, _, body = rec.calls[0]
    assert (method, path) == ("POST", "/v1/completions")
    assert body == {
        "model": "Qwen/Qwen3-0.6B", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0.7,
        "top_p": 0.9, "seed": 42, "stop_token_ids": [151645], "logprobs": 0,
        "return_token_ids": True, "return_tokens_as_token_ids": True,
        "skip_special_tokens": False, "n": 1,
    }  # fmt: skip
    assert c.token_ids.tolist() == [5, 6, 151645] and c.token_ids.dtype == np.uint32
    assert c.logprobs.tolist() == pytest.approx([-0.5, -1.0, -0.1])
    assert c.logprobs.dtype == np.float32
    assert (c.finish_reason, c.prompt_tokens, c.model, c.backend) == (
        "stop",
        3,
        "Qwen/Qwen3-0.6B",
        "b0",
    )
    assert c.policy_version == 0  # vLLM does not say; nothing was set or read yet


def test_old_vllm_without_token_ids_falls_back_to_logprob_tokens() -> None:
    rec = Recorder({"/v1/completions": vllm_completion([9, 8], [-1.0, -2.0], with_ids=False)})
    c = asyncio.run(backend(rec).complete([1], max_tokens=2))
    assert c.token_ids.tolist() == [9, 8]


@pytest.mark.parametrize(
    "answer",
    [
        {"choices": []},
        {"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}]},
        {"choices": [{"token_ids": [1], "logprobs": None}]},
        {"choices": [{"token_ids": None, "logprobs": {"tokens": ["hi"], "token_logprobs": [-1]}}]},
        {"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [None]}}]},
        # out of bounds: a token id past uint32, a policy version past 2**53 - 1
        {"choices": [{"token_ids": [2**40], "logprobs": {"token_logprobs": [-1.0]}}]},
        {"choices": [{"token_ids": [-1], "logprobs": {"token_logprobs": [-1.0]}}]},
        {
            "choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-1.0]}}],
            "policy_version": 2**64 - 1,
        },
    ],
)
def test_unusable_answers_are_protocol_errors(answer: dict) -> None:  # type: ignore[type-arg]
    rec = Recorder({"/v1/completions": answer})
    with pytest.raises(BackendProtocolError):
        asyncio.run(backend(rec).complete([1], max_tokens=2))


def _status(code: int, body: Any) -> Handler:
    return lambda request: httpx.Response(code, json=body)


@pytest.mark.parametrize(
    ("status", "body", "error", "message"),
    [
        (500, {"error": {"message": "CUDA OOM", "code": 500}}, BackendUnavailable, "CUDA OOM"),
        (503, {"detail": "paused"}, BackendUnavailable, "paused"),
        (400, {"error": {"message": "max context length", "code": 400}}, BackendRejected, "max"),
        (404, {"object": "error", "message": "no such model"}, BackendRejected, "no such model"),
    ],
)
def test_http_errors_map_to_the_hierarchy(
    status: int, body: Any, error: type, message: str
) -> None:
    route = _status(status, body)
    with pytest.raises(error, match=message) as info:
        asyncio.run(backend(Recorder({"/v1/completions": route})).complete([1], max_tokens=2))
    assert info.value.status == status and info.value.backend == "b0"
    assert isinstance(info.value, BackendError)


def test_transport_errors_are_unavailable_and_health_never_raises() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    b = backend(Recorder({"/v1/completions": refuse, "/health": refuse}))
    with pytest.raises(BackendUnavailable, match="refused"):
        asyncio.run(b.complete([1], max_tokens=2))
    assert asyncio.run(b.health()) is False
    assert asyncio.run(backend(Recorder({"/health": _status(503, {})})).health()) is False
    assert asyncio.run(backend(Recorder({"/health": _status(200, {})})).health()) is True


def test_vllm_reload_pauses_reloads_versions_and_resumes() -> None:
    ok: dict[str, Any] = {}
    rec = Recorder({
        "/pause": {"status": "paused"}, "/resume": {"status": "resumed"},
        "/collective_rpc": {"results": [None]}, "/update_weight_version": ok,
        "/weight_info": {"weight_version": "7"},
        "/v1/completions": vllm_completion([1], [-0.1]),
    })  # fmt: skip

    async def main() -> None:
        b = backend(rec)
        assert await b.reload_weights("/ckpt/step-7", 7) == 7
        assert (await b.complete([1], max_tokens=1)).policy_version == 7
        assert await b.policy_version() == 7

    asyncio.run(main())
    assert rec.calls[:4] == [
        ("POST", "/pause", {"mode": "wait", "wait_for_inflight_requests": "true"}, None),
        ("POST", "/collective_rpc", {},
         {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step-7"}}),
        ("POST", "/update_weight_version", {}, {"new_version": "7"}),
        ("POST", "/resume", {}, None),
    ]  # fmt: skip
    assert rec.paths()[4:] == ["/v1/completions", "/weight_info"]


def test_vllm_reload_resumes_even_when_the_reload_fails() -> None:
    rec = Recorder({
        "/pause": {}, "/resume": {},
        "/collective_rpc": _status(500, {"detail": "no such file"}),
    })  # fmt: skip
    with pytest.raises(BackendUnavailable, match="no such file"):
        asyncio.run(backend(rec).reload_weights("/missing", 3))
    assert rec.paths() == ["/pause", "/collective_rpc", "/resume"]


def test_vllm_reload_inside_a_caller_pause_leaves_it_paused() -> None:
    rec = Recorder(
        {"/pause": {}, "/resume": {}, "/collective_rpc": {}, "/update_weight_version": {}}
    )

    async def main() -> None:
        b = backend(rec)
        await b.pause("abort")
        await b.reload_weights("/ckpt", 2)
        await b.resume()

    asyncio.run(main())
    assert rec.paths() == ["/pause", "/collective_rpc", "/update_weight_version", "/resume"]
    assert rec.calls[0][2] == {"mode": "abort", "wait_for_inflight_requests": "false"}


@pytest.mark.parametrize(("raw", "expected"), [("12", 12), (None, 0), (3, 3)])
def test_vllm_weight_version_parsing(raw: Any, expected: int) -> None:
    rec = Recorder({"/weight_info": {"weight_version": raw}})
    assert asyncio.run(backend(rec).policy_version()) == expected


def test_vllm_non_integer_weight_version_is_a_protocol_error() -> None:
    rec = Recorder({"/weight_info": {"weight_version": "step-abc"}})
    with pytest.raises(BackendProtocolError):
        asyncio.run(backend(rec).policy_version())


def test_reference_reload_uses_load_weights() -> None:
    rec = Recorder({
        "/v1/load_weights": {"policy_version": 4, "path": "/w", "load_s": 0.01},
        "/v1/policy_version": {"policy_version": 4, "weights_path": "/w", "loaded_at": 0},
    })  # fmt: skip

    async def main() -> None:
        b = backend(rec, kind="reference")
        assert await b.reload_weights("/w", 4) == 4
        assert await b.policy_version() == 4

    asyncio.run(main())
    assert rec.calls[0] == ("POST", "/v1/load_weights", {}, {"path": "/w", "version": 4})


def test_reference_reload_with_an_unbounded_version_is_a_protocol_error() -> None:
    rec = Recorder({"/v1/load_weights": {"policy_version": 2**64, "path": "/w"}})
    with pytest.raises(BackendProtocolError, match="policy_version"):
        asyncio.run(backend(rec, kind="reference").reload_weights("/w", 4))


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        CompletionBackend("http://x", "b", kind="sglang")  # type: ignore[arg-type]
