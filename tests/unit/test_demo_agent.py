"""The demo's parts: reward functions, tasks (as the rollout service's tasks, whose hidden test
is checked by the real suite runner in a real ``local`` sandbox), the agent against a fake
proxy at the HTTP edge (a local HTTP server answering chat completions and tool-call records),
the evaluator, the round's job spec, the fold of the rollouts' events into the table's rows,
the reward-per-version table; and the configuration doc is current."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollstream.infra import configdoc
from rollstream.infra.demo import rewards_by_version
from rollstream.infra.demo.agent import (
    ANSWERS,
    AgentResult,
    count_digits,
    demo_tasks,
    digit_fraction,
    digit_rewards,
    read_answers,
    run_agent,
    to_task,
)
from rollstream.infra.demo.evaluator import score_answers, score_texts
from rollstream.infra.demo.service import ResultFold, demo_job, job_prefix
from rollstream.producers.rollouts.agents import AgentContext, RolloutEndpoint, build_agent
from rollstream.producers.rollouts.evaluators import SuiteEvaluator, build_evaluator
from rollstream.producers.rollouts.jobs import (
    PythonAgentSpec,
    expand,
    group_id,
    parse_job,
    resolve_tasks,
)
from rollstream.producers.rollouts.local import LocalProvider
from rollstream.producers.rollouts.sandbox import Sandbox, SandboxLimits, SandboxSpec
from rollstream.schemas import (
    Event,
    LlmCall,
    Reward,
    RewardKind,
    RolloutFinished,
    RolloutStarted,
    RolloutStatus,
)


def test_digit_fraction() -> None:
    assert digit_fraction("") == 0.0
    assert digit_fraction("   ") == 0.0
    assert digit_fraction("42") == 1.0
    assert digit_fraction("a1 b2") == 0.5
    assert digit_rewards(["1x", "xx", "99"]) == [0.5, 0.0, 1.0]
    assert count_digits("a1b22") == "3"


def test_tasks_are_deterministic() -> None:
    assert demo_tasks(3, seed=1) == demo_tasks(3, seed=1)
    assert len({t.task_id for t in demo_tasks(4)}) == 4


def test_rewards_by_version_uses_first_call_version_and_skips_failures() -> None:
    results = [
        AgentResult("r1", "t", "g", 2, 0, [0.0, 1.0], 0.5, [0, 1]),
        AgentResult("r2", "t", "g", 2, 0, [1.0, 1.0], 1.0, [1, 1]),
        AgentResult("r3", "t", "g", 0, 0, [], 0.0, [2], error="boom"),
    ]
    assert rewards_by_version(results) == {0: [0.5], 1: [1.0]}


def test_configuration_doc_is_current() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert doc.read_text() == configdoc.render(), (
        "docs/configuration.md is stale: python -m rollstream.infra.configdoc > "
        "docs/configuration.md"
    )


def test_every_setting_has_a_meaning() -> None:
    assert [line for line in configdoc.render().splitlines() if line.endswith("|  |")] == []


class _Documented:
    beside: int = 1  # the comment beside
    # a block
    # of two lines
    above: int = 2
    # a section

    bare: int = 3


def test_a_settings_meaning_is_the_comment_beside_else_the_block_right_above() -> None:
    assert configdoc._comments(_Documented) == {
        "beside": "the comment beside",
        "above": "a block of two lines",
    }


# --------------------------------------------------------------------------- tasks, evaluator


@pytest.fixture
def provider(tmp_path: Path) -> LocalProvider:
    return LocalProvider(tmp_path / "sandboxes")


def task_sandbox(provider: LocalProvider, answers: list[str] | None = None) -> Sandbox:
    task = to_task(demo_tasks(1)[0])
    files = {path: text.encode() for path, text in task.workdir_files().items()}
    if answers is not None:
        question, _ = read_answers(files[ANSWERS])
        files[ANSWERS] = json.dumps({"question": question, "answers": answers}).encode()
    return provider.create(SandboxSpec(kind="local", files=files, limits=SandboxLimits(timeout=20)))


def test_a_demo_task_is_a_coding_task_whose_hidden_test_checks_the_answers(
    provider: LocalProvider,
) -> None:
    demo = demo_tasks(1)[0]
    task = to_task(demo)
    assert task.prompt == demo.question and task.task_id == demo.task_id
    assert read_answers(task.files[ANSWERS].encode()) == (demo.question, [])
    assert task.hidden_test_names() == ["test_answers.py::test_every_answer_is_digits_only"]
    suite = SuiteEvaluator()
    for answers, final in ((["42", " 1 3 "], 1.0), (["42", "4x"], 0.0), ([], 0.0)):
        with task_sandbox(provider, answers) as sb:
            evaluation = suite.evaluate(task, sb, time.monotonic() + 20)
        assert (evaluation.status, evaluation.final) == ("ok", final), evaluation


def test_the_evaluator_scores_what_the_agent_wrote(provider: LocalProvider) -> None:
    evaluation = score_texts(["12", "1x", "  "])
    assert evaluation.final == pytest.approx(0.5)
    assert evaluation.milestones == (("turn-0", 1.0), ("turn-1", 0.5), ("turn-2", 0.0))
    assert (evaluation.passed, evaluation.total) == (1, 3)
    assert score_texts([]).final == 0.0
    task = to_task(demo_tasks(1)[0])
    with task_sandbox(provider, ["7", "ab"]) as sb:
        assert score_answers(task, sb).final == 0.5
        sb.copy_in(b"not json", ANSWERS)
        with pytest.raises(ValueError):
            score_answers(task, sb)


# --------------------------------------------------------------------------- the agent


class FakeProxy(BaseHTTPRequestHandler):
    """Chat completions answered from ``replies`` (in order), tool calls recorded."""

    replies: list[str] = []
    chats: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    status = 200

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert self.headers["authorization"] == "Bearer tok"
        if self.path.endswith("/chat/completions"):
            self.chats.append(body)
            n = len(self.chats)
            answer: dict[str, Any] = {
                "choices": [{"message": {"role": "assistant", "content": self.replies.pop(0)}}],
                "rollstream": {"call_id": f"c{n}", "policy_version": 0},
            }
        else:
            self.tools.append(body)
            answer = {"tool_call_id": f"t{len(self.tools)}"}
        data = json.dumps(answer).encode()
        self.send_response(self.status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def proxy() -> Iterator[str]:
    FakeProxy.replies, FakeProxy.chats, FakeProxy.tools, FakeProxy.status = [], [], [], 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeProxy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def agent_context(sb: Sandbox, url: str, rollout_id: str = "r1") -> AgentContext:
    endpoint = RolloutEndpoint(rollout_id, f"{url}/rollouts/{rollout_id}/v1", "tok", url)
    return AgentContext(sb, "add-0", "", endpoint, time.monotonic() + 30)


def test_the_agent_answers_records_its_tool_and_writes_the_answers(
    provider: LocalProvider, proxy: str
) -> None:
    FakeProxy.replies = ["no digits", "4 2", "x7"]
    with task_sandbox(provider) as sb:
        outcome = run_agent(agent_context(sb, proxy), turns=2, max_tokens=5)
        question, answers = read_answers(sb.copy_out(ANSWERS))
    assert (outcome.status, outcome.stop, outcome.turns) == ("ok", "max_turns", 2)
    assert answers == ["4 2", "x7"]  # the digit-less first reply was asked again (a rewind)
    chats = FakeProxy.chats
    assert chats[0]["messages"] == chats[1]["messages"]  # the same context, another seed
    assert chats[0]["messages"][1] == {"role": "user", "content": question}
    assert chats[1]["seed"] == chats[0]["seed"] + 50 and chats[0]["max_tokens"] == 5
    assert chats[2]["messages"][-1]["content"] == "[count_digits] 2. Again, digits only."
    assert [t["at_call_id"] for t in FakeProxy.tools] == ["c2", "c3"]
    assert [t["result"] for t in FakeProxy.tools] == ["2", "1"]


def test_each_rollout_samples_with_its_own_seed(provider: LocalProvider, proxy: str) -> None:
    FakeProxy.replies = ["1", "2"]
    with task_sandbox(provider) as sb:
        run_agent(agent_context(sb, proxy, "r1"), turns=1)
        run_agent(agent_context(sb, proxy, "r2"), turns=1)
    assert FakeProxy.chats[0]["seed"] != FakeProxy.chats[1]["seed"]


def test_a_refusing_proxy_fails_the_run(provider: LocalProvider, proxy: str) -> None:
    FakeProxy.replies, FakeProxy.status = ["1"], 409
    with task_sandbox(provider) as sb:
        outcome = run_agent(agent_context(sb, proxy), turns=2)
        assert read_answers(sb.copy_out(ANSWERS))[1] == []
    assert outcome.status == "failed" and "409" in outcome.reason


# --------------------------------------------------------------------------- the round's job


def test_a_round_is_a_job_of_the_demo_agent_and_evaluator() -> None:
    prefix = job_prefix("demo.ns/1", "abc123")
    tasks = demo_tasks(3)
    job = demo_job(prefix, 7, tasks, group_size=8, turns=2, max_tokens=12, run_id="demo-run")
    assert job.id == "demo-ns-1-abc123-r7" and job.samples_per_task == 8
    assert job.sandbox.kind == "local" and job.run_id == "demo-run"
    assert isinstance(job.agent, PythonAgentSpec)
    assert job.agent.options == {"turns": 2, "max_tokens": 12}
    assert parse_job(job.model_dump(mode="json")) == job
    assert [t.task_id for t in resolve_tasks(job)] == [t.task_id for t in tasks]
    plans = expand(job, resolve_tasks(job))
    assert len(plans) == 24 and {p.group_id for p in plans} == {
        group_id(job.id, t.task_id) for t in tasks
    }  # one GRPO group per task per round
    assert build_agent(job.agent).name.endswith("agent:run_agent")
    assert build_evaluator(job.evaluator).name.endswith("evaluator:score_answers")
    assert job_prefix("x" * 60, "n").startswith("x" * 24 + "-n")


# --------------------------------------------------------------------------- results


def event(rid: str, seq: int, body: Any) -> Event:
    return Event(event_id=f"{rid}-{seq}", rollout_id=rid, seq=seq, ts=0, body=body)


def llm_call(version: int) -> LlmCall:
    empty = np.zeros(0, np.uint32)
    return LlmCall(
        call_id="c", parent_call_id=None, prefix_len=0, prompt_delta=empty,
        completion_ids=empty, completion_logprobs=np.zeros(0, np.float32),
        policy_version=version,
    )  # fmt: skip


def test_the_rollouts_events_fold_into_the_tables_rows() -> None:
    fold = ResultFold()
    fold.feed(
        [
            event("j-r1-a", 0, RolloutStarted(task_id="add-0", group_id="g0")),
            event("j-r1-a", 1, llm_call(3)),
            event("j-r1-a", 2, llm_call(3)),
            event("j-r1-a", 3, llm_call(4)),
            event("j-r1-a", 4, Reward(0.5, RewardKind.MILESTONE, "turn-0")),
            event("j-r1-a", 5, Reward(1.0, RewardKind.MILESTONE, "turn-1")),
            event("j-r1-a", 6, Reward(0.75, RewardKind.FINAL, "x")),
            event("j-r1-a", 7, RolloutFinished(RolloutStatus.COMPLETED)),
            event("j-r1-b", 0, RolloutStarted(task_id="add-1", group_id="g1")),
            event("j-r1-b", 1, RolloutFinished(RolloutStatus.FAILED, "run: boom")),
            event("j-r1-c", 0, RolloutStarted(task_id="add-1", group_id="g1")),
            event("j-r10-d", 0, RolloutFinished(RolloutStatus.COMPLETED)),
        ]
    )
    assert sorted(fold.finished("j-r1-")) == ["j-r1-a", "j-r1-b"]
    rows = {r.rollout_id: r for r in fold.round_results("j-r1-", 3)}
    assert rows["j-r1-a"] == AgentResult(
        "j-r1-a", "add-0", "g0", 2, 1, [0.5, 1.0], 0.75, [3, 3, 4], None
    )
    assert rows["j-r1-b"].error == "failed: run: boom"
    missing = [r for r in rows.values() if r.rollout_id.startswith("j-r1-?")]
    assert len(rows) == 3 and [r.error for r in missing] == ["not finished"]
    assert fold.result("j-r10-d").error == "no final reward"
    assert rewards_by_version(list(rows.values())) == {3: [0.75]}
