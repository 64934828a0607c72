"""The demo's built-in agent and task suite: a small multi-turn harness that knows nothing of
rollstream but its HTTP rollout API and an OpenAI base URL (what a real harness would use).

Each task asks for numbers. Per turn the agent asks the model (through the recording proxy),
runs a local tool (``count_digits``) on the answer, shows the tool's result to the model as the
next user message, and posts a milestone reward: the fraction of the answer's characters that
are digits. An answer with no digit at all is retried once from the same context (a rewind:
the proxy records it as a branch of the tree). The final reward is the mean milestone over
turns, so a group of rollouts has spread and the policy gradient has a direction: a random
tiny model starts near 0.05 and the trained one climbs. Reward functions are plain callables
(TRL's list in, list out).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = [
    "AgentResult",
    "DemoAgent",
    "DemoTask",
    "count_digits",
    "demo_tasks",
    "digit_fraction",
    "digit_rewards",
]

SYSTEM = "You are a terse calculator. Answer with digits only."


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


@dataclass
class AgentResult:
    rollout_id: str
    task_id: str
    group_id: str
    turns: int
    retries: int
    milestones: list[float] = field(default_factory=list)
    final: float = 0.0
    policy_versions: list[int] = field(default_factory=list)
    error: str | None = None


class DemoAgent:
    """Runs rollouts of ``DemoTask``s through the proxy's rollout API and OpenAI endpoint."""

    def __init__(
        self,
        proxy_url: str,
        *,
        model: str = "rollstream-tiny",
        turns: int = 2,
        max_tokens: int = 16,
        temperature: float = 1.0,
        admin_key: str | None = None,
        timeout: float = 120.0,
    ) -> None:
        self.proxy_url = proxy_url.rstrip("/")
        self.model = model
        self.turns = turns
        self.max_tokens = max_tokens
        self.temperature = temperature
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._admin = httpx.Client(base_url=self.proxy_url, headers=headers, timeout=timeout)
        self._timeout = timeout

    def close(self) -> None:
        self._admin.close()

    def proxy_status(self) -> dict[str, Any]:
        """The proxy's admin status (served policy version, pool, delivery counters)."""
        resp = self._admin.get("/v1/admin/status")
        resp.raise_for_status()
        data: dict[str, Any] = resp.json()
        return data

    def _chat(self, http: httpx.Client, messages: list[dict[str, Any]], seed: int) -> Any:
        resp = http.post(
            "chat/completions",
            json={
                "model": self.model,
                "messages": messages,
                "max_tokens": self.max_tokens,
                "temperature": self.temperature,
                "seed": seed,
            },
        )
        resp.raise_for_status()
        return resp.json()

    def run(
        self, task: DemoTask, group_id: str, *, group_size: int, run_id: str, seed: int
    ) -> AgentResult:
        created = self._admin.post(
            "/v1/rollouts",
            json={
                "task_id": task.task_id,
                "group_id": group_id,
                "group_size": group_size,
                "run_id": run_id,
                "harness": "rollstream-demo-agent",
            },
        )
        created.raise_for_status()
        info = created.json()
        rid, token = info["rollout_id"], info["token"]
        result = AgentResult(rid, task.task_id, group_id, 0, 0)
        auth = {"Authorization": f"Bearer {token}"}
        base = info["base_url"].rstrip("/") + "/"
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task.question},
        ]
        status, error = "completed", None
        try:
            with httpx.Client(base_url=base, headers=auth, timeout=self._timeout) as http:
                for turn in range(self.turns):
                    reply = self._chat(http, messages, seed * 100 + turn)
                    text = reply["choices"][0]["message"].get("content") or ""
                    if digit_fraction(text) == 0.0:  # retry once from the same context
                        result.retries += 1
                        reply = self._chat(http, messages, seed * 100 + turn + 50)
                        text = reply["choices"][0]["message"].get("content") or ""
                    ext = reply.get("rollstream", {})
                    result.policy_versions.append(int(ext.get("policy_version", 0)))
                    call_id = ext.get("call_id")
                    t0 = time.perf_counter()
                    tool_out = count_digits(text)
                    tool_ms = (time.perf_counter() - t0) * 1000
                    value = digit_fraction(text)
                    result.milestones.append(value)
                    self._post(
                        rid,
                        auth,
                        "tool_calls",
                        {
                            "name": "count_digits",
                            "arguments": {"text": text[:200]},
                            "result": tool_out,
                            "duration_ms": tool_ms,
                            "at_call_id": call_id,
                        },
                    )
                    self._post(
                        rid,
                        auth,
                        "rewards",
                        {
                            "value": value,
                            "kind": "milestone",
                            "name": f"turn-{turn}",
                            "at_call_id": call_id,
                            "evaluator": "digit_fraction",
                        },
                    )
                    messages += [
                        {"role": "assistant", "content": text},
                        {
                            "role": "user",
                            "content": f"[count_digits] {tool_out}. Again, digits only.",
                        },
                    ]
                    result.turns += 1
            result.final = sum(result.milestones) / max(len(result.milestones), 1)
            self._post(
                rid,
                auth,
                "rewards",
                {
                    "value": result.final,
                    "kind": "final",
                    "name": "mean-digit-fraction",
                    "evaluator": "digit_fraction",
                },
            )
        except Exception as exc:  # the rollout fails; the run goes on
            status, error = "failed", f"{type(exc).__name__}: {exc}"
            result.error = error
        self._post(rid, auth, "finish", {"status": status, "error": error})
        return result

    def _post(self, rid: str, auth: dict[str, str], what: str, body: dict[str, Any]) -> None:
        resp = self._admin.post(f"/v1/rollouts/{rid}/{what}", json=body, headers=auth)
        resp.raise_for_status()
