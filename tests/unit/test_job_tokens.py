"""Job evaluator tokens (producers/proxy/job_tokens.py): a token opens its own job only, a
tampered one opens nothing, and the two token kinds of one secret never stand in for each other
(rollout tokens, rollout_api.RolloutTokens, sign the bare rollout id; job tokens a domain tag and
the job id)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from rollstream.producers.proxy.job_tokens import PREFIX, JobTokens, job_id_problem
from rollstream.producers.proxy.rollout_api import RolloutTokens
from rollstream.producers.rollouts.jobs import JobId

SECRET = b"job-token-secret-of-32-bytes-len"
JOB_IDS = st.from_regex(r"\A[A-Za-z0-9](?:[A-Za-z0-9_-]{0,38}[A-Za-z0-9])?\Z")


def test_a_token_opens_its_job_and_verifies_with_the_same_secret_only() -> None:
    tokens = JobTokens(SECRET)
    token = tokens.issue("job-a")
    assert token.startswith(PREFIX + "job-a.")
    assert tokens.verify(token) == "job-a"
    assert JobTokens(SECRET).verify(token) == "job-a"  # a restart with the same secret
    assert JobTokens(b"another-secret-of-32-bytes-long!").verify(token) is None
    assert tokens.issue("job-a") == token  # deterministic: nothing to store


def test_another_jobs_name_or_a_tampered_signature_opens_nothing() -> None:
    tokens = JobTokens(SECRET)
    token = tokens.issue("job-a")
    sig = token.rpartition(".")[2]
    assert tokens.verify(f"{PREFIX}job-b.{sig}") is None  # job a's signature on job b
    flipped = sig[:-1] + ("A" if sig[-1] != "A" else "B")
    for bad in (
        f"{PREFIX}job-a.{flipped}",
        f"{PREFIX}job-a.",
        f"{PREFIX}job-a",
        f"{PREFIX}.{sig}",
        token + "x",
        token + ".x",
        " " + token,
        token.replace(PREFIX, "RS1J."),
        f"{PREFIX}job-ä.{sig}",  # non-ASCII
        "",
    ):
        assert tokens.verify(bad) is None, bad


def test_a_rollout_token_is_no_job_token_and_a_job_token_no_rollout_token() -> None:
    rollouts = RolloutTokens(SECRET)
    jobs = rollouts.jobs  # the same secret, as the proxy has them
    for name in ("job-a", "a", "x" * 40):
        job_token, rollout_token = jobs.issue(name), rollouts.issue(name)
        assert rollouts.verify(job_token) is None
        assert jobs.verify(rollout_token) is None
        # the other kind's prefix on the same name and signature
        job_sig, rollout_sig = job_token.rpartition(".")[2], rollout_token.rpartition(".")[2]
        assert job_sig != rollout_sig
        assert rollouts.verify(f"{RolloutTokens.PREFIX}{name}.{job_sig}") is None
        assert jobs.verify(f"{PREFIX}{name}.{rollout_sig}") is None


@given(JOB_IDS)
def test_every_job_id_of_the_jobs_contract_round_trips(job_id: str) -> None:
    TypeAdapter(JobId).validate_python(job_id)  # the contract takes it
    assert job_id_problem(job_id) is None
    tokens = JobTokens(SECRET)
    assert tokens.verify(tokens.issue(job_id)) == job_id


@pytest.mark.parametrize(
    "job_id",
    ["", "x" * 41, "-job", "job-", "_job", "job.a", "job/a", "job a", "job\n", "jöb", "a\x00b"],
)
def test_ids_outside_the_jobs_contract_get_no_token(job_id: str) -> None:
    with pytest.raises(ValidationError):
        TypeAdapter(JobId).validate_python(job_id)  # the contract refuses it too
    problem = job_id_problem(job_id)
    assert problem is not None and "`job_id`" in problem
    tokens = JobTokens(SECRET)
    with pytest.raises(ValueError, match="job_id"):
        tokens.issue(job_id)
    forged = f"{PREFIX}{job_id}.{tokens._sig(job_id)}"  # signed as if it were one
    assert tokens.verify(forged) is None


def test_the_secret_and_the_token_are_bounded() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        JobTokens(b"short")
    tokens = JobTokens(SECRET)
    longest = tokens.issue("x" * 40)
    assert tokens.verify(longest) == "x" * 40
    assert tokens.verify(longest + "A" * 10_000) is None  # refused before any HMAC
