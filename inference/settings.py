"""Settings of the reference inference server (``rollstream serve-model``, ``make-model``).

Light on purpose: pydantic only, so ``rollstream serve-model --help`` names the variables and
their defaults without torch installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import SecretStr

from rollstream.schemas.settings import NONE_FROM_ENV, CommonSettings

__all__ = ["LogprobsMode", "ModelServerSettings"]

# The logprob of a sampled token: after temperature (the default) or of the raw logits (vLLM's).
LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]


class ModelServerSettings(CommonSettings):
    """Settings of the reference inference server (ROLLSTREAM_MODEL_*)."""

    model_config = NONE_FROM_ENV

    model_path: Path | None = None  # default: <home>/models/tiny
    model_name: str = "rollstream-tiny"  # the model id the API answers to
    model_host: str = "127.0.0.1"  # where the server listens
    model_port: int = 8100  # ... and its port
    model_seed: int = 0  # seeds the tiny model when created, and requests sent without a seed
    model_create: bool = True  # create the tiny model at model_path when none is there
    model_max_batch: int = 16  # requests generated together in one batch
    model_batch_wait_ms: float = 2.0  # wait this long for company before a batch starts
    model_max_len: int | None = None  # default: the model's max_position_embeddings
    model_max_queue: int = 4096  # queued requests beyond this are refused with a 503
    model_max_request_bytes: int = 8 * 1024 * 1024  # larger request bodies get a 413
    model_logprobs_mode: LogprobsMode = "processed_logprobs"  # or raw_logprobs (vLLM's)
    model_device: str = "cpu"  # torch device of the model
    model_torch_threads: int | None = 1  # none or 0: torch's default (all cores); 1: robust
    model_log_level: str = "warning"  # uvicorn's log level
    # Generation and the read-only routes take model_api_key (vLLM's --api-key; the proxy sends
    # ROLLSTREAM_PROXY_BACKEND_API_KEY); unset, they are open and the server warns at start. The
    # weight and control routes (/v1/load_weights, /pause, /resume, /collective_rpc,
    # /update_weight_version) take model_admin_key only (the proxy sends
    # ROLLSTREAM_PROXY_BACKEND_ADMIN_KEY), which opens the other routes too; unset, they take
    # model_api_key and the server warns at start. Both unset: <home>/keys.json's model and
    # admin keys.
    model_api_key: SecretStr | None = None  # bearer key of generation and the read-only routes
    model_admin_key: SecretStr | None = None  # bearer key of the weight routes (unset: model key)

    def resolved_model_path(self) -> Path:
        return self.model_path if self.model_path is not None else self.home / "models" / "tiny"
