"""The OpenAPI 3.1 document of the reference inference server (``GET /openapi.json``): every
route of server.py, its request body and query schema with the bounds the server enforces
(wire.py), its error answers (vLLM's error body) and the key it takes: ``adminKey``
(``model_admin_key``) on the weight and control routes, ``modelKey`` (``model_api_key``) or
``adminKey`` on the others, none on /health, the probes and this document. Pure: no HTTP
library, no torch."""

from __future__ import annotations

from typing import Any

from rollstream.schemas.events import POLICY_VERSION_MAX, SAFE_INT_MAX, TOKEN_ID_MAX

__all__ = ["MAX_TOP_LOGPROBS", "OPENAPI"]

MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs; wire.MAX_TOP_LOGPROBS (a test holds them)
_STATUS = {
    400: "bad request",
    401: "missing or wrong metrics key",  # the model key's 401 is added by _openapi
    404: "unknown model",
    409: "stale version",
    413: "request body too large",
    503: "not loaded, paused for a weight update, queue full or shutting down",
}


def _schema(required: str, **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": required.split(), "properties": props}


def _int(lo: int = -SAFE_INT_MAX, hi: int = SAFE_INT_MAX) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


_S, _B = {"type": "string"}, {"type": "boolean"}
_TOKENS = {"type": "array", "minItems": 1, "items": _int(0, TOKEN_ID_MAX)}  # each < vocab size
_PROMPT = {"oneOf": [{**_S, "minLength": 1}, _TOKENS]}
_SAMPLING: dict[str, Any] = {
    "model": _S,
    "max_tokens": _int(1),  # and prompt + max_tokens <= max_model_len
    "temperature": {"type": "number", "minimum": 0, "maximum": SAFE_INT_MAX},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "seed": _int(),
    "logprobs": _int(0, MAX_TOP_LOGPROBS),
    "stop_token_ids": {"type": "array", "items": _int(0, TOKEN_ID_MAX)},
    "ignore_eos": _B,
    "n": {"const": 1},
    "stream": {"const": False},
    "echo": {"const": False},
    "use_beam_search": {"const": False},
}
_COMPLETION = _schema(
    "prompt",
    prompt={"oneOf": [*_PROMPT["oneOf"], {"type": "array", "minItems": 1, "items": _PROMPT}]},
    return_token_ids=_B,
    return_tokens_as_token_ids=_B,
    skip_special_tokens=_B,
    **{**_SAMPLING, "stream": _B},  # one prompt per streamed request
    stream_options=_schema("", include_usage=_B),
)
_MESSAGE = _schema("role content", role=_S, content=_S)
_CHAT = _schema(
    "messages",
    messages={"type": "array", "minItems": 1, "items": _MESSAGE},
    **{**_SAMPLING, "stream": _B},
    stream_options=_schema("", include_usage=_B),
)
_LOAD = _schema("path", path={**_S, "minLength": 1}, version=_int(0, POLICY_VERSION_MAX))
_RPC = _schema(
    "method kwargs",
    method={"const": "reload_weights"},
    kwargs=_schema("weights_path", weights_path={**_S, "minLength": 1}),
)
_VERSION = _schema(
    "new_version",
    new_version={"oneOf": [{**_S, "pattern": "^[0-9]{1,16}$"}, _int(0, POLICY_VERSION_MAX)]},
)
_OPEN = ("/health", "/livez", "/readyz", "/openapi.json")  # answered without a key
# the weight and control routes: model_admin_key only (server.ADMIN_ROUTES; a test holds them)
_ADMIN = ("/v1/load_weights", "/pause", "/resume", "/collective_rpc", "/update_weight_version")
_MODE = {"name": "mode", "in": "query", "schema": {"enum": ["abort", "wait", "keep"]}}
_EXAMPLES = {
    "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 4, "seed": 0, "logprobs": 1,
                        "return_token_ids": True},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/load_weights": {"path": "/nonexistent/checkpoint", "version": 1},
    "/collective_rpc": {"method": "reload_weights",
                        "kwargs": {"weights_path": "/nonexistent/checkpoint"}},
    "/update_weight_version": {"new_version": "0"},
}  # fmt: skip

# (path, method, summary, request body schema, query parameters, error statuses)
_ROUTES: list[tuple[str, str, str, dict[str, Any] | None, list[dict[str, Any]], str]] = [
    ("/v1/completions", "post", "completion of token ids or text (vLLM's shapes)", _COMPLETION,
     [], "400 404 413 503"),
    ("/v1/chat/completions", "post", "plain chat: the messages rendered with the chat template",
     _CHAT, [], "400 404 413 503"),
    ("/v1/models", "get", "the model card (max_model_len, policy_version)", None, [], "503"),
    ("/health", "get", "200 once the model is loaded", None, [], "503"),
    ("/v1/policy_version", "get", "the loaded version and its weights path", None, [], "503"),
    ("/v1/load", "get", "queued and running requests", None, [], "503"),
    ("/v1/load_weights", "post", "load a checkpoint between two batches", _LOAD, [],
     "400 409 413 503"),
    ("/pause", "post", "hold new batches (abort, wait for or keep the batch in flight)", None,
     [_MODE], "400 503"),
    ("/resume", "post", "serve again", None, [], "503"),
    ("/is_paused", "get", "whether the server is paused", None, [], "503"),
    ("/collective_rpc", "post", "vLLM's reload_weights", _RPC, [], "400 413 503"),
    ("/update_weight_version", "post", "set the reported policy version", _VERSION, [],
     "400 413 503"),
    ("/weight_info", "get", "the reported policy version", None, [], "503"),
    ("/metrics", "get", "Prometheus metrics (behind the metrics key when one is set)", None, [],
     "401"),
    ("/livez", "get", "liveness", None, [], ""),
    ("/readyz", "get", "readiness: loaded, scheduler running, not paused", None, [], "503"),
    ("/openapi.json", "get", "this document", None, [], ""),
]  # fmt: skip


def _openapi() -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    paths: dict[str, Any] = {}
    for path, method, summary, body, query, codes in _ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "ok"}}}
        for code in codes.split():
            op["responses"][code] = {"description": _STATUS[int(code)], **error}
        if body is not None:
            content = {"schema": body, "example": _EXAMPLES[path]}
            op["requestBody"] = {"required": True, "content": {"application/json": content}}
        if query:
            op["parameters"] = query
        if path == "/metrics":
            op["security"] = [{"metricsKey": []}]  # when metrics_key is set
        elif path in _ADMIN:  # when model_admin_key is set (else model_api_key, if set)
            op["security"] = [{"adminKey": []}]
            op["responses"]["401"] = {"description": "missing or wrong admin key", **error}
        elif path not in _OPEN:  # when model_api_key is set
            op["security"] = [{"modelKey": []}, {"adminKey": []}]
            op["responses"]["401"] = {"description": "missing or wrong API key", **error}
        paths[path] = {method: op}
    nullable = {"type": ["string", "null"]}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "rollstream reference inference server",
            "version": "1",
            "description": (
                "vLLM's token-id completion API over the tiny local model. Token ids are in "
                f"[0, vocab size) (at most {TOKEN_ID_MAX}); prompt + max_tokens is at most the "
                f"model's context length; logprobs in [0, {MAX_TOP_LOGPROBS}]; n is 1; "
                "stream: true on /v1/completions answers vLLM's streamed chunks (SSE, one prompt); "
                "echo and beam search are refused (400)."
            ),
        },
        "paths": paths,
        "components": {
            "securitySchemes": {
                "modelKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "model_api_key: generation and the read-only routes",
                },
                "adminKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": (
                        "model_admin_key: the weight and control routes (model_api_key while "
                        "no admin key is set), and every other route that takes a key"
                    ),
                },
                "metricsKey": {"type": "http", "scheme": "bearer", "description": "metrics_key"},
            },
            "schemas": {
                "Error": _schema(
                    "error",
                    error=_schema(
                        "message type", message=_S, type=_S, param=nullable, code=_int(400, 599)
                    ),
                ),
            },
        },
    }


OPENAPI: dict[str, Any] = _openapi()
