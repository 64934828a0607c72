"""Settings of the rollout service's workers (``rollstream run-job``): where the recording
proxy is, the admin and evaluator keys its rollout API wants (unset: from ``<home>/keys.json``,
schemas/keys.py), where sandboxes live, and how many rollouts run at once. Every field is a
``ROLLSTREAM_ROLLOUTS_*`` variable (docs/configuration.md)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from rollstream.schemas import CommonSettings

__all__ = ["RolloutSettings"]


class RolloutSettings(CommonSettings):
    rollouts_proxy_url: str = "http://127.0.0.1:8200"  # the recording proxy (its rollout API)
    rollouts_admin_key: SecretStr | None = None  # an admin key of the proxy (secret)
    # an evaluator key of the proxy: the EVAL stage's final rewards and finish (secret)
    rollouts_evaluator_key: SecretStr | None = None  # EVAL stage's proxy key; unset: admin key
    rollouts_sandbox_root: Path | None = None  # bwrap/local sandboxes; unset: <home>/sandboxes
    rollouts_docker_url: str | None = None  # dockerd for docker sandboxes; unset: DOCKER_HOST
    rollouts_concurrency: int = Field(default=2, ge=1, le=256)  # rollouts at once per worker
    rollouts_worker_id: str = ""  # labels this worker's sandboxes; unset: host-pid
    rollouts_stages: str = "all"  # stages a `rollstream workers` process serves: init|run|eval|all
    rollouts_sweep_s: float = Field(default=30.0, ge=0.5, le=3600)  # claims of dead workers
    rollouts_report_s: float = Field(default=2.0, ge=0.2, le=60)  # load reports (control.workers)
    rollouts_follow_controller: bool = True  # RUN limit from the controller's newest decision

    def sandbox_root(self) -> Path:
        return self.rollouts_sandbox_root or self.home / "sandboxes"
