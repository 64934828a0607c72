"""Job evaluator tokens: a bearer token that opens the evaluator routes of one job's rollouts.
Pure: the standard library only.

    JobTokens(secret).issue(job_id) -> "rs1j.<job_id>.<sig>"
    JobTokens(secret).verify(token) -> the job id it opens, or None
    job_id_problem(job_id) -> None, or what is wrong with it

``sig`` is base64url(HMAC-SHA256(secret, DOMAIN + job_id)) with the proxy's rollout token secret
(``proxy_token_secret``; unset: random per start), so a token verifies across a proxy restart
exactly when rollout tokens do. Rollout tokens (rollout_api.RolloutTokens, ``rs1.``) sign the
bare rollout id, which matches ``[A-Za-z0-9_-]{1,128}``; job tokens sign ``DOMAIN`` (spaces and
a NUL byte) followed by the job id, so no input of one kind is ever an input of the other: a job
token never verifies as a rollout token and a rollout token never verifies as a job token, even
with its prefix rewritten.

A job id is the jobs contract's (rollouts/jobs.py ``JobId``): 1 to 40 characters of
``[A-Za-z0-9_-]``, first and last alphanumeric. It holds no ``.``, so the token splits one way.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from typing import Final

__all__ = ["DOMAIN", "JOB_ID", "PREFIX", "JobTokens", "job_id_problem"]

PREFIX: Final = "rs1j."
DOMAIN: Final = b"rollstream job evaluator token\x00"
JOB_ID: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,38}[A-Za-z0-9])?")  # jobs.py JobId
MAX_TOKEN: Final = len(PREFIX) + 40 + 1 + 43  # the longest job id and a SHA-256 sig, unpadded


def job_id_problem(job_id: str) -> str | None:
    """None for a job id of the jobs contract, else what is wrong with it (for a 400)."""
    if JOB_ID.fullmatch(job_id) is None:
        return "`job_id` must be 1 to 40 characters of [A-Za-z0-9_-], first and last alphanumeric"
    return None


class JobTokens:
    """Issues and checks job evaluator tokens (module docstring)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the token secret must be at least 16 bytes")
        self._secret = secret

    def _sig(self, job_id: str) -> str:
        mac = hmac.new(self._secret, DOMAIN + job_id.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def issue(self, job_id: str) -> str:
        """The token of ``job_id``; ValueError for an id outside the jobs contract."""
        problem = job_id_problem(job_id)
        if problem is not None:
            raise ValueError(problem)
        return f"{PREFIX}{job_id}.{self._sig(job_id)}"

    def verify(self, token: str) -> str | None:
        """The job id ``token`` opens, or None when it is no valid job token."""
        if len(token) > MAX_TOKEN or not token.isascii() or not token.startswith(PREFIX):
            return None  # a non-ASCII token is no token of ours (and hmac cannot compare it)
        job_id, dot, sig = token[len(PREFIX) :].partition(".")
        if not dot or JOB_ID.fullmatch(job_id) is None:
            return None
        if not hmac.compare_digest(sig, self._sig(job_id)):
            return None
        return job_id
