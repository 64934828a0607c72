"""Settings of the recording proxy (``ProxySettings``: ROLLSTREAM_PROXY_*, and the recorder's
ROLLSTREAM_* too; documented in docs/configuration.md). Built by ``rollstream proxy`` and passed
down; nothing else in the proxy reads the environment."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import NoDecode

from rollstream.producers.proxy.tool_formats import ToolFormatSetting
from rollstream.producers.sdk.settings import RecorderSettings

__all__ = ["HttpClient", "ProxySettings", "WeightUpdateMode"]

# The HTTP client of the per-call hop to the backends (bench/bench_proxy.py --http-client).
HttpClient = Literal["http1", "aiohttp", "httpx"]
# How a weight update treats the generations in flight (pool.py): wait for them, or cut them
# and continue them on the new weights (partial rollouts).
WeightUpdateMode = Literal["drain", "interrupt"]


def _split_list(value: Any) -> Any:
    """``a,b`` or a JSON list (environment) or a list (code) -> list."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [v.strip() for v in text.split(",") if v.strip()]
    return value


class ProxySettings(RecorderSettings):
    """Settings of the recording proxy (ROLLSTREAM_PROXY_*; the recorder's ROLLSTREAM_* too).
    List settings accept a JSON list or a comma-separated string."""

    producer: str = Field(default_factory=lambda: f"proxy@{socket.gethostname()}")
    spool_dir: Path | None = Path(".rollstream/spool-proxy")
    proxy_host: str = "127.0.0.1"  # address the proxy listens on
    proxy_port: int = 8200  # its port
    # base URLs of the model servers (a JSON list or comma-separated)
    proxy_backends: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["http://127.0.0.1:8100"]
    )
    proxy_backend_kind: Literal["reference", "vllm"] = "reference"  # reference or vllm
    proxy_backend_model: str | None = None  # the model name sent to the backends
    proxy_backend_api_key: SecretStr | None = None  # bearer key sent to the backends
    # sent instead on the weight and control routes (load_weights, pause, resume, collective_rpc,
    # update_weight_version: the model server's model_admin_key); unset: proxy_backend_api_key
    proxy_backend_admin_key: SecretStr | None = None  # bearer key of the backends' weight routes
    # how replies' tool calls are read: auto = chosen by the model's chat template (tool_formats.py)
    proxy_tool_format: ToolFormatSetting = "auto"
    proxy_backend_timeout_s: float = 300.0  # longest wait for a backend's answer
    # http1: our lean HTTP/1.1 client, the fastest per call (bench/bench_proxy.py
    # --http-client http1,aiohttp,httpx); aiohttp comes with the proxy extra; https://
    # backends always go through httpx
    proxy_http_client: HttpClient = "http1"  # client of each call to a backend: http1|aiohttp|httpx
    proxy_model_path: Path | None = None  # tokenizer + chat template; default <home>/models/tiny
    proxy_model_name: str = "rollstream-tiny"  # the id /v1/models shows
    proxy_max_model_len: int | None = None  # default: the model's max_position_embeddings
    proxy_max_prompt_tokens: int | None = None  # default: max_model_len
    proxy_default_max_tokens: int = 1024  # chat calls without max_tokens (capped by the room)
    proxy_max_body_bytes: int = 8 * 1024 * 1024  # larger requests: 413
    # admin keys, which open every route (unset: the admin key of <home>/keys.json; none: open)
    proxy_api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    # keys that may score, finish and post lifecycle events of open rollouts (the EVAL stage),
    # and nothing else: no creation, no admin route, no model call (unset: <home>/keys.json)
    proxy_evaluator_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    proxy_token_secret: SecretStr | None = None  # HMAC key of rollout tokens; None: random
    proxy_public_url: str | None = None  # base of the base_url handed out; default: request's
    proxy_pause_wait_s: float = 60.0  # a paused call waits this long, then gets 429
    proxy_retry_after_s: float = 2.0  # Retry-After of 429 and 503 answers
    proxy_backend_wait_s: float = 30.0  # how long a call waits for a healthy backend
    proxy_health_interval_s: float = 2.0  # backends probed this often
    proxy_rollout_idle_s: float = 3600.0  # rollouts idle this long are finished (timeout)
    proxy_log_level: str = "warning"  # debug, info, warning, error
    proxy_follow_policy: bool = False  # consume policy.versions: pause, drain, reload, resume
    # drain: a weight update waits for the generations in flight (each completion is of one
    # policy version); interrupt: it cuts them and they go on under the new weights, each
    # token recorded with its own version (partial rollouts; docs/proxy.md)
    proxy_weight_update_mode: WeightUpdateMode = "drain"
    # rate limit per rollout token (its model calls and rollout API requests; admin keys are not
    # limited): a token bucket (ratelimit.py); over it, 429 rate_limit_exceeded + Retry-After
    proxy_rate_limit_rps: float = Field(20.0, ge=0, le=1e5)  # requests/s per token; 0: no limit
    proxy_rate_limit_burst: int = Field(40, ge=1, le=1_000_000)  # requests a token may burst
    # what the proxy holds in memory: open rollouts, and per rollout its model calls and the
    # tokens of its context trie (unique prompt + completion tokens)
    proxy_max_open_rollouts: int = Field(10_000, ge=1, le=1_000_000)  # past it: 503
    proxy_max_rollout_calls: int = Field(10_000, ge=1, le=1_000_000)  # past it: 409
    proxy_max_rollout_tokens: int = Field(16_000_000, ge=1_024, le=2**31)  # past it: 409

    _lists = field_validator(
        "proxy_backends", "proxy_api_keys", "proxy_evaluator_keys", mode="before"
    )(_split_list)

    def resolved_model_path(self) -> Path:
        return self.proxy_model_path or self.home / "models" / "tiny"
