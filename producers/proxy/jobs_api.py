"""The proxy's job routes: a team that speaks only HTTP submits rollout jobs to the rollout
service's queue through the proxy (rollouts/jobqueue.py does the Kafka side):

    POST /v1/jobs            admin key  a job spec as JSON (rollouts/jobs.py JobSpec)
                                        -> 202 {job_id, rollouts, topic}
    GET  /v1/jobs            admin key  -> {"jobs": [one row per job]}
    GET  /v1/jobs/{job_id}   admin key  -> the job's status (rollouts/jobstatus.py JobStatus),
                                        with "training": its samples trained and dropped
                                        (stale, duplicate, skipped) and rollouts wasted
    POST /v1/jobs/{job_id}/evaluator-token
                             admin or   -> {job_id, token}: the job's evaluator token
                             evaluator  (job_tokens.py), for an evaluator that should score and
                             key        finish that job's rollouts only (rollout_api.py)

The evaluator-token route asks no queue: both keys that may call it open every job's rollouts
already, and a token of a job not submitted (yet) opens no rollout until one is created with
that ``job_id`` in its metadata. A bad job id is a 400 naming ``job_id`` (after the key check:
a caller without a key learns nothing about ids).

A spec that cannot be used is a 400 whose ``param`` is the path of the bad value
(``agent.max_turns``); ``tasks.path`` is refused (400, param ``tasks.path``): files on the
proxy's host are not read for callers (send ``tasks.suite`` or ``tasks.inline``). A job id
submitted already is a 409 (``job_exists``), an unknown one a 404; the queue unreachable or a
record not acknowledged is a 503. The body is bounded by ``proxy_max_body_bytes`` as every
route's.

The Kafka calls block, so they run in a worker thread; the producer is built from the proxy's
settings on the first submit and flushed by ``close``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from rollstream.producers.errors import (
    ApiError,
    JobExists,
    JobNotFound,
    JobQueueError,
    JobSpecError,
)
from rollstream.producers.proxy.job_tokens import job_id_problem
from rollstream.producers.proxy.openai_wire import Answer, HttpRequest, json_answer
from rollstream.producers.proxy.rollout_api import Auth
from rollstream.producers.proxy.settings import ProxySettings
from rollstream.producers.rollouts import jobqueue
from rollstream.producers.rollouts.jobs import parse_job
from rollstream.producers.rollouts.jobstatus import job_rows

__all__ = ["JobsApi"]

_JOB_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


class JobsApi:
    """Handlers of the job routes (module docstring), over the proxy's settings and auth."""

    def __init__(self, settings: ProxySettings, auth: Auth, *, producer: Any = None) -> None:
        self.settings, self.auth = settings, auth
        self._producer = producer
        self._lock = threading.Lock()

    def _out(self) -> Any:
        with self._lock:
            if self._producer is None:
                self._producer = jobqueue.build_producer(self.settings)
            return self._producer

    def close(self, timeout: float = 10.0) -> None:
        """Flush what the producer holds (each submit has flushed its own records already)."""
        if self._producer is not None:
            self._producer.flush(timeout)

    async def submit(self, request: HttpRequest) -> Answer:
        self.auth.admin(request.token)
        body = await request.json()
        tasks = body.get("tasks") if isinstance(body, dict) else None
        if isinstance(tasks, dict) and "path" in tasks:
            msg = (
                "tasks.path is not accepted over HTTP: files on the proxy's host are not read "
                "for callers (send tasks.suite or tasks.inline)"
            )
            raise ApiError(400, msg, code="invalid_job", param="tasks.path")
        try:
            job = parse_job(body)
            record = await asyncio.to_thread(
                jobqueue.submit_job, self.settings, job, producer=self._out()
            )
        except JobSpecError as exc:
            where = f"{exc.field}: " if exc.field else ""
            raise ApiError(
                400, where + exc.message, code="invalid_job", param=exc.field or None
            ) from exc
        except JobExists as exc:
            raise ApiError(409, str(exc), code="job_exists", param="job_id") from exc
        except JobQueueError as exc:
            raise ApiError(503, str(exc), code="job_queue_unavailable") from exc
        topic = self.settings.topics().task("init")
        return json_answer(
            {"job_id": record.job_id, "rollouts": record.rollouts, "topic": topic}, 202
        )

    async def list(self, request: HttpRequest) -> Answer:
        self.auth.admin(request.token)
        try:
            records = await asyncio.to_thread(jobqueue.list_jobs, self.settings)
        except JobQueueError as exc:
            raise ApiError(503, str(exc), code="job_queue_unavailable") from exc
        return json_answer({"jobs": job_rows(records)})

    async def status(self, request: HttpRequest) -> Answer:
        self.auth.admin(request.token)
        job_id = request.path["job_id"]
        if not 0 < len(job_id) <= 40 or not set(job_id) <= _JOB_ID_CHARS:
            raise ApiError(400, "not a job id", code="invalid_job", param="job_id")
        try:
            status = await asyncio.to_thread(jobqueue.job_status, self.settings, job_id)
        except JobNotFound as exc:
            raise ApiError(404, str(exc), code="job_not_found", param="job_id") from exc
        except JobQueueError as exc:
            raise ApiError(503, str(exc), code="job_queue_unavailable") from exc
        return json_answer(status.to_json())

    async def evaluator_token(self, request: HttpRequest) -> Answer:
        """The job's evaluator token (module docstring) for the admin or an evaluator key."""
        self.auth.evaluator_or_admin(request.token)
        job_id = request.path["job_id"]
        problem = job_id_problem(job_id)
        if problem is not None:
            raise ApiError(400, problem, code="invalid_value", param="job_id")
        return json_answer({"job_id": job_id, "token": self.auth.tokens.jobs.issue(job_id)})
