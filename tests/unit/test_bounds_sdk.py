"""Every value has a bound (schemas/events.py): the pure checks at their edges, and the harness
SDK refusing values past them at the call site (a ValueError naming the argument, nothing
recorded) where numpy or the Avro writer would otherwise wrap them silently."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from rollstream.producers import (
    ContextError,
    MemoryTransport,
    Recorder,
    RecorderSettings,
    RecorderUsageError,
)
from rollstream.schemas import Codec, Event, LlmCall, Reward, RolloutStarted, Topics
from rollstream.schemas.events import (
    METADATA_MAX_CHARS,
    METADATA_MAX_KEYS,
    POLICY_VERSION_MAX,
    REWARD_BOUND,
    SAMPLING_MAX_KEYS,
    TOKEN_ID_MAX,
    U32,
    metadata_problem,
    policy_version_problem,
    reward_problem,
    token_ids_problem,
)

NS = "bounds"
TOPIC = Topics(NS).events
codec = Codec()


def test_policy_version_bound_and_why() -> None:
    """2**53 - 1: what every JSON reader reads back exactly, inside Avro's long."""
    assert POLICY_VERSION_MAX == 2**53 - 1 == float(POLICY_VERSION_MAX)
    for ok in (0, 7, POLICY_VERSION_MAX, np.int64(3)):
        assert policy_version_problem(ok) is None, ok
    for bad in (-1, POLICY_VERSION_MAX + 1, 2**63, 2**64 - 1):
        assert "must be in [0, 9007199254740991]" in str(policy_version_problem(bad)), bad
    for bad_type in (True, 1.0, "1", None):
        assert "must be an integer" in str(policy_version_problem(bad_type)), bad_type


def test_reward_bound_edges() -> None:
    for ok in (0, -1, REWARD_BOUND, -REWARD_BOUND, np.float32(0.5), 10**6):
        assert reward_problem(ok) is None, ok
    for bad in (math.nan, math.inf, -math.inf, 1e308, REWARD_BOUND + 1, 10**400, -(10**7)):
        assert "finite number in [-1e+06, 1e+06]" in str(reward_problem(bad)), bad
    for bad_type in (True, "1", None, [1.0]):
        assert "must be a number" in str(reward_problem(bad_type)), bad_type


def test_token_ids_bound_edges() -> None:
    assert np.iinfo(U32).max == TOKEN_ID_MAX
    ok = [np.zeros(0), np.asarray([0, TOKEN_ID_MAX]), np.asarray([1, 2], dtype=U32)]
    for arr in ok:
        assert token_ids_problem(arr) is None, arr
    bad = {
        "[0, 4294967295]": [np.asarray([-1]), np.asarray([TOKEN_ID_MAX + 1]), np.asarray([2**63])],
        "not object": [np.asarray([2**64]), np.asarray([2**70, 1], dtype=object)],
        "not float64": [np.asarray([1.0])],
        "not bool": [np.asarray([True])],
        "one-dimensional": [np.zeros((2, 2), dtype=U32)],
    }
    for words, arrays in bad.items():
        for arr in arrays:
            assert words in str(token_ids_problem(arr)), (words, arr)


def test_metadata_bound_edges() -> None:
    assert metadata_problem({str(i): "v" for i in range(METADATA_MAX_KEYS)}) is None
    assert metadata_problem({"k": "v" * METADATA_MAX_CHARS}) is None
    many = {str(i): "v" for i in range(METADATA_MAX_KEYS + 1)}
    assert f"more than {METADATA_MAX_KEYS}" in str(metadata_problem(many))
    assert "longer than" in str(metadata_problem({"k": "v" * (METADATA_MAX_CHARS + 1)}))


# --- the SDK ----------------------------------------------------------------------------------


def recorder(tmp_path: Path, transport: MemoryTransport) -> Recorder:
    settings = RecorderSettings(namespace=NS, spool_dir=tmp_path / "spool", producer="bounds")
    return Recorder(settings, transport=transport)


def events_of(transport: MemoryTransport) -> list[Event]:
    return [codec.decode(m.value) for m in transport.messages(TOPIC)]


def test_rollout_refuses_values_past_their_bounds_and_records_nothing(tmp_path: Path) -> None:
    transport = MemoryTransport()
    with recorder(tmp_path, transport) as rec:
        cases = {
            "policy_version": {"policy_version": 2**64 - 1},  # was written as -1
            "attempt": {"attempt": 2**63},
            "group_size": {"group_size": -1},
            "sampling['temperature']": {"sampling": {"temperature": 10**400}},
            "sampling has more": {"sampling": {str(i): 1.0 for i in range(SAMPLING_MAX_KEYS + 1)}},
            "metadata": {"metadata": {str(i): i for i in range(METADATA_MAX_KEYS + 1)}},
        }
        for name, kwargs in cases.items():
            with pytest.raises(ValueError, match=name.replace("[", r"\[")) as err:
                rec.rollout(task_id="t", group_id="g", **kwargs)  # type: ignore[arg-type]
            assert isinstance(err.value, RecorderUsageError)
        with rec.rollout(task_id="t", group_id="g", policy_version=POLICY_VERSION_MAX) as r:
            r.llm_call([1, 2], [3], [-0.5], policy_version=POLICY_VERSION_MAX)
        assert rec.flush(5)
    events = events_of(transport)
    assert [e.kind for e in events] == ["RolloutStarted", "LlmCall", "RolloutFinished"]
    started, call = events[0].body, events[1].body
    assert isinstance(started, RolloutStarted) and isinstance(call, LlmCall)
    assert started.policy_version == call.policy_version == POLICY_VERSION_MAX  # read back exactly


def test_llm_call_refuses_token_ids_and_versions_that_would_wrap(tmp_path: Path) -> None:
    transport = MemoryTransport()
    with recorder(tmp_path, transport) as rec:
        r = rec.rollout(task_id="t", group_id="g")
        bad_completions = (
            [TOKEN_ID_MAX + 1],
            [2**64],
            np.asarray([-1]),  # numpy's cast would have made it 4294967295
            [1.5],
        )
        for completion in bad_completions:
            with pytest.raises(RecorderUsageError, match="completion_ids"):
                r.llm_call([1], completion, [0.0])
        with pytest.raises(ContextError, match="token ids"):  # the prompt: checked by the trie
            r.llm_call(np.asarray([5, -1]), [1], [0.0])
        with pytest.raises(ContextError, match="token ids"):
            r.llm_call([2**63], [1], [0.0])
        for version in (2**64 - 1, -1, POLICY_VERSION_MAX + 1):
            with pytest.raises(RecorderUsageError, match="policy_version"):
                r.llm_call([1], [2], [0.0], policy_version=version)
        with pytest.raises(RecorderUsageError, match="drift_tokens"):
            r.llm_call([1], [2], [0.0], drift_tokens=-1)
        with pytest.raises(RecorderUsageError, match="logprobs must be numbers"):
            r.llm_call([1], [2], ["x"])
        r.llm_call(np.asarray([0, TOKEN_ID_MAX], dtype=np.int64), [TOKEN_ID_MAX], [-1.0])
        r.finish()
        assert rec.flush(5)
    events = events_of(transport)
    assert [e.kind for e in events] == ["RolloutStarted", "LlmCall", "RolloutFinished"]
    (call,) = [e.body for e in events if isinstance(e.body, LlmCall)]
    assert call.prompt_delta.tolist() == [0, TOKEN_ID_MAX]
    assert call.completion_ids.tolist() == [TOKEN_ID_MAX]
    assert call.parent_call_id is None  # none of the refused calls reached the trie


def test_reward_refuses_non_finite_and_out_of_bound_values(tmp_path: Path) -> None:
    transport = MemoryTransport()
    with recorder(tmp_path, transport) as rec:
        r = rec.rollout(task_id="t", group_id="g")
        for bad in (math.nan, math.inf, -math.inf, REWARD_BOUND * 2, -1e308, 10**400, True):
            with pytest.raises(ValueError, match="value must be") as err:
                r.reward(bad)
            assert isinstance(err.value, RecorderUsageError)
        r.reward(REWARD_BOUND)
        r.reward(-REWARD_BOUND, "penalty")
        r.finish()
        assert rec.flush(5)
    rewards = [e.body for e in events_of(transport) if isinstance(e.body, Reward)]
    assert [w.value for w in rewards] == [REWARD_BOUND, -REWARD_BOUND]


def test_tool_call_arguments_too_deep_for_json_are_a_usage_error(tmp_path: Path) -> None:
    transport = MemoryTransport()
    deep: list[object] = []
    for _ in range(100_000):  # past Python's recursion limit
        deep = [deep]
    with recorder(tmp_path, transport) as rec:
        r = rec.rollout(task_id="t", group_id="g")
        with pytest.raises(RecorderUsageError, match="arguments cannot be written as JSON"):
            r.tool_call("search", arguments=deep)
        r.tool_call("search", arguments={"q": [[["ok"]]]})
        r.finish()
        assert rec.flush(5)
    assert [e.kind for e in events_of(transport)] == [
        "RolloutStarted",
        "ToolCall",
        "RolloutFinished",
    ]
