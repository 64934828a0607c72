"""The OpenAPI 3.1 document of the analytics server (``GET /openapi.json``): every route of
server.py, its body or query schema with the bounds the server enforces, its security (the
analyst key) and its error answers. Pure: no HTTP library, no ClickHouse client.

    openapi(views) -> dict     ``views``: each canned view's name -> {parameter: ClickHouse type}
                               (reports.VIEWS; the server passes its own)

The web UI's data endpoints (ui_api.py) are listed one path each, their query parameters taken
from the endpoint's pydantic model, bounds included."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollstream.consumers.analytics.ui_api import ENDPOINTS
from rollstream.schemas.events import POLICY_VERSION_MAX, SAFE_INT_MAX

__all__ = ["openapi"]

_STATUS = {
    400: "bad request, or a query the engine refused or that broke a limit",
    401: "missing or invalid analyst key",
    403: "a refused query, or another namespace",
    404: "no such view or UI endpoint",
    413: "request body too large",
}
_S = {"type": "string"}
_SCALAR = {"type": ["string", "integer", "number", "boolean", "null"]}
_FILTER = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "since_us": {"type": ["integer", "null"], "minimum": 0, "maximum": SAFE_INT_MAX},
        "until_us": {"type": ["integer", "null"], "minimum": 0, "maximum": SAFE_INT_MAX},
        "task_ids": {"type": "array", "items": _S},
        "group_ids": {"type": "array", "items": _S},
        "run_ids": {"type": "array", "items": _S},
        "rollout_ids": {"type": "array", "items": _S},
        "policy_versions": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": POLICY_VERSION_MAX},
        },
    },
}
_NAMESPACE = {"type": ["string", "null"], "description": "must be the server's namespace (403)"}
_QUERY = {
    "type": "object",
    "required": ["sql"],
    "properties": {
        "sql": {**_S, "minLength": 1},
        "params": {
            "type": "object",
            "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]{0,63}$"},
            "additionalProperties": {"oneOf": [_SCALAR, {"type": "array", "items": _SCALAR}]},
        },
    },
    "example": {"sql": "SELECT count() FROM rollout_status"},
}
_EVENTS = {
    "type": "object",
    "properties": {
        "namespace": _NAMESPACE,
        "filter": _FILTER,
        "after": {"type": ["string", "null"], "description": "the last page's last rollout_id"},
        "limit": {"type": "integer", "minimum": 1, "maximum": SAFE_INT_MAX, "default": 500},
    },
    "example": {"filter": {}, "limit": 10},
}
_COUNT = {"type": "object", "properties": {"namespace": _NAMESPACE, "filter": _FILTER}}
_NS_PARAM = {"name": "namespace", "in": "query", "schema": _S}


def _query_param(name: str, schema: dict[str, Any], required: bool) -> dict[str, Any]:
    """A query parameter from a pydantic property (its null alternative dropped)."""
    options = [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]
    keep = ("type", "minimum", "maximum", "minLength", "maxLength", "enum")
    return {
        "name": name,
        "in": "query",
        "required": required,
        "schema": {k: v for k, v in options[0].items() if k in keep},
    }


def _view_param(name: str, kind: str) -> dict[str, Any]:
    low = kind.lower()
    if "int" in low:
        hi = 2**32 - 1 if "uint32" in low else SAFE_INT_MAX
        schema = {"type": "integer", "minimum": 0 if low.startswith("uint") else -hi, "maximum": hi}
    elif "float" in low:
        schema = {"type": "number", "minimum": -SAFE_INT_MAX, "maximum": SAFE_INT_MAX}
    else:
        schema = {"type": "string"}
    return {"name": name, "in": "query", "schema": schema}


def _op(summary: str, codes: str, *, body: Any = None, params: Any = None) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    op: dict[str, Any] = {
        "summary": summary,
        "security": [{"analystKey": []}],
        "responses": {"200": {"description": "ok"}},
    }
    for code in codes.split():
        op["responses"][code] = {"description": _STATUS[int(code)], **error}
    if body is not None:
        content = {"schema": body, **({"example": body["example"]} if "example" in body else {})}
        op["requestBody"] = {"required": True, "content": {"application/json": content}}
    if params:
        op["parameters"] = params
    return op


def openapi(views: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """The document, with one path per canned view in ``views`` (name -> parameter types)."""
    paths: dict[str, Any] = {
        "/health": {"get": {**_op("liveness; with the key also database, namespace and the "
                                  "sink's counters", ""), "security": [{"analystKey": []}, {}]}},
        "/query": {"post": _op("a read-only SQL query (three checks: docs/analytics.md)",
                               "400 401 403 413", body=_QUERY)},
        "/reports": {"get": _op("the canned views and their parameters", "401")},
        "/events": {"post": _op("a page of whole rollouts as length-prefixed Avro frames",
                                "400 401 403 413", body=_EVENTS)},
        "/events/count": {"post": _op("rollouts and events a filter selects", "400 401 403 413",
                                      body=_COUNT)},
        "/openapi.json": {"get": {"summary": "this document", "responses": {
            "200": {"description": "ok"}}}},
    }  # fmt: skip
    for name, types in views.items():
        params = [_NS_PARAM, *(_view_param(k, t) for k, t in types.items())]
        paths[f"/reports/{name}"] = {
            "get": _op(f"canned view {name}", "400 401 403", params=params)
        }
    for name, endpoint in ENDPOINTS.items():
        schema = endpoint.params.model_json_schema()
        required = set(schema.get("required", ()))
        params = [_NS_PARAM] + [
            _query_param(k, v, k in required) for k, v in schema["properties"].items()
        ]
        paths[f"/ui/api/{name}"] = {
            "get": _op(f"web UI data: {name}", "400 401 403", params=params)
        }
    paths["/ui/api/lag"] = {
        "get": _op("web UI data: consumer lag of the namespace's groups, read from Kafka "
                   "(every 5 s at most; {groups: [], error} when the broker does not answer)",
                   "401 403", params=[_NS_PARAM])
    }  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "rollstream analytics server",
            "version": "1",
            "description": (
                "Read-only queries over one namespace's ClickHouse database. Every route but "
                "/health and this document wants the analyst key when keys are set. Bodies "
                "are bounded by analytics_max_body_bytes (413); queries by the session's "
                "time, memory and result limits (400 naming the limit). Never a 500."
            ),
        },
        "paths": paths,
        "components": {
            "securitySchemes": {"analystKey": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {"error": _S},
                }
            },
        },
    }
