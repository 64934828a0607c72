"""The demo's agent and task suite, run by the rollout service: a small multi-turn harness that
knows nothing of rollstream but the rollout's OpenAI endpoint and its sandbox.

Each task asks for a number. The task's starting file, ``answers.json``, holds the question;
the agent (``run_agent``, a ``python`` agent of the job: the RUN stage calls it with the
rollout's ``AgentContext``) asks the model that question through the recording proxy, runs a
local tool (``count_digits``) on the answer, records the tool call, shows its result to the
model as the next user message, and writes every answer into ``answers.json`` in the sandbox.
An answer with no digit at all is asked again once from the same context (a rewind: the proxy
records it as a branch of the tree). The evaluator (demo/evaluator.py) scores what the agent
wrote: a milestone per turn, the fraction of the answer's characters that are digits, and the
final reward, their mean; so a group of rollouts has spread and the policy gradient has a
direction: a random tiny model starts near 0.05 and the trained one climbs. Reward functions
are plain callables (TRL's list in, list out). The task's hidden test (every answer all digits)
is the same bar as a final reward of 1.0.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from rollstream.producers.errors import RolloutCallError, SandboxError
from rollstream.producers.rollouts.agents import (
    AgentContext,
    AgentOutcome,
    AgentStatus,
    RolloutClient,
)
from rollstream.producers.rollouts.tasks import Task

__all__ = [
    "ANSWERS",
    "AgentResult",
    "DemoTask",
    "count_digits",
    "demo_tasks",
    "digit_fraction",
    "digit_rewards",
    "read_answers",
    "run_agent",
    "to_task",
]

SYSTEM: Final = "You are a terse calculator. Answer with digits only."
ANSWERS: Final = "answers.json"  # the starting file: the question; the agent adds its answers
MAX_ANSWER_CHARS: Final = 4096

HIDDEN_TEST: Final = """import json


def test_every_answer_is_digits_only():
    with open("answers.json", encoding="utf-8") as fh:
        answers = json.load(fh)["answers"]
    assert answers, "no answer"
    for answer in answers:
        chars = "".join(answer.split())
        assert chars and all(c in "0123456789" for c in chars), answer
"""


@dataclass(frozen=True, slots=True)
class DemoTask:
    task_id: str
    question: str


def demo_tasks(n: int = 4, seed: int = 0) -> list[DemoTask]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append(DemoTask(f"add-{i}", f"What is {a} + {b}? Reply with the number."))
    return out


def to_task(task: DemoTask) -> Task:
    """The rollout service's task of a demo task: the question as the prompt, ``answers.json``
    (holding the question) as the starting file, a hidden test that checks the answers."""
    return Task(
        task_id=task.task_id,
        title=task.question[:120],
        difficulty="easy",
        prompt=task.question,
        files={ANSWERS: json.dumps({"question": task.question, "answers": []}) + "\n"},
        hidden_tests={"test_answers.py": HIDDEN_TEST},
        tags=["demo"],
    )


def digit_fraction(text: str) -> float:
    """Share of non-space characters that are ASCII digits (0 for an empty answer)."""
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c in "0123456789" for c in chars) / len(chars)


def digit_rewards(completions: Sequence[str]) -> list[float]:
    """TRL-style reward function: list of completions in, list of rewards out."""
    return [digit_fraction(c) for c in completions]


def count_digits(text: str) -> str:
    """The local tool: counts the digits in a text."""
    return str(sum(c in "0123456789" for c in text))


def read_answers(data: bytes) -> tuple[str, list[str]]:
    """(question, answers) of an ``answers.json``; ValueError when it is not one."""
    doc = json.loads(data)
    if not isinstance(doc, dict):
        raise ValueError(f"{ANSWERS} is not a JSON object")
    question, answers = doc.get("question"), doc.get("answers")
    if not isinstance(question, str) or not question:
        raise ValueError(f"{ANSWERS}: no question")
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{ANSWERS}: answers is not a list of strings")
    return question, answers


@dataclass
class AgentResult:
    """One rollout as the demo's table and plot see it (built from its events)."""

    rollout_id: str
    task_id: str
    group_id: str
    turns: int
    retries: int
    milestones: list[float] = field(default_factory=list)
    final: float = 0.0
    policy_versions: list[int] = field(default_factory=list)
    error: str | None = None


def _seed(rollout_id: str) -> int:
    """A sampling seed per rollout (each sample of a group differs; the same rollout id, the
    same seed)."""
    return int(hashlib.sha256(rollout_id.encode()).hexdigest()[:8], 16)


def env_seconds(rollout_id: str, turn: int, median_s: float, sigma: float, cap_s: float) -> float:
    """The simulated environment time of one tool call: lognormal with median ``median_s`` and
    shape ``sigma`` (long-tailed: with sigma 1.0 the mean is 1.65x the median and one call in
    100 takes 10x the median), capped at ``cap_s``; the same for the same rollout and turn."""
    if median_s <= 0:
        return 0.0
    rng = random.Random(_seed(rollout_id) * 1000 + turn)
    return min(rng.lognormvariate(math.log(median_s), sigma), cap_s)


def run_agent(
    ctx: AgentContext,
    *,
    turns: int = 2,
    max_tokens: int = 16,
    temperature: float = 1.0,
    model: str = "rollstream-tiny",
    env_median_s: float = 0.0,
    env_sigma: float = 1.0,
    env_max_s: float = 60.0,
) -> AgentOutcome:
    """The RUN stage of one demo rollout (module docstring). A proxy that refuses or does not
    answer is a ``failed`` outcome; the deadline a ``timeout`` (the answers so far are
    scored). ``env_median_s`` > 0 gives each tool call an environment time (``env_seconds``:
    long-tailed, as sandbox commands and tests are), spent waiting as a real tool would."""
    if not (0 <= env_median_s <= 600 and 0 <= env_sigma <= 5 and 0 <= env_max_s <= 3600):
        return AgentOutcome("failed", "error", "env_median_s, env_sigma or env_max_s out of bounds")
    t0 = time.monotonic()
    try:
        question, _ = read_answers(ctx.sandbox.copy_out(ANSWERS))
    except (SandboxError, ValueError) as exc:
        return AgentOutcome("failed", "error", f"no question: {exc}")
    seed = _seed(ctx.endpoint.rollout_id)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    answers: list[str] = []

    def chat(client: RolloutClient, turn_seed: int) -> tuple[str, str | None]:
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": turn_seed,
        }
        reply = client.chat(body, deadline=ctx.deadline)
        text = str(reply["choices"][0]["message"].get("content") or "")[:MAX_ANSWER_CHARS]
        call_id = (reply.get("rollstream") or {}).get("call_id")
        return text, call_id if isinstance(call_id, str) else None

    def outcome(status: AgentStatus, stop: str, reason: str = "") -> AgentOutcome:
        return AgentOutcome(
            status,
            stop,
            reason,
            turns=len(answers),
            tool_calls=len(answers),
            duration_s=time.monotonic() - t0,
        )

    with RolloutClient(ctx.endpoint) as client:
        for turn in range(turns):
            if ctx.remaining() <= 0:
                return outcome("timeout", "deadline", f"the deadline passed after {turn} turns")
            try:
                text, call_id = chat(client, seed * 100 + turn)
                if digit_fraction(text) == 0.0:  # asked again once from the same context
                    text, call_id = chat(client, seed * 100 + turn + 50)
                t = time.perf_counter()
                wait = env_seconds(
                    ctx.endpoint.rollout_id, turn, env_median_s, env_sigma, env_max_s
                )
                time.sleep(max(min(wait, ctx.remaining()), 0.0))
                tool_out = count_digits(text)
                client.tool_call(
                    name="count_digits",
                    arguments=json.dumps({"text": text[:200]}),
                    result=tool_out,
                    is_error=False,
                    duration_ms=(time.perf_counter() - t) * 1000,
                    sandbox=ctx.sandbox.id,
                    at_call_id=call_id,
                    tool_call_id=None,
                )
                answers.append(text)
                doc = {"question": question, "answers": answers}
                ctx.sandbox.copy_in(json.dumps(doc).encode(), ANSWERS)
            except (RolloutCallError, SandboxError, KeyError, IndexError, TypeError) as exc:
                if ctx.remaining() <= 0:
                    return outcome("timeout", "deadline", f"cut by the deadline: {exc}")
                return outcome("failed", "error", f"turn {turn}: {type(exc).__name__}: {exc}")
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"[count_digits] {tool_out}. Again, digits only."},
            ]
    return outcome("ok", "max_turns")
