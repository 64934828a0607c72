"""``rollstream demo`` (``make demo``): the local stack end to end, as far as it is built.

Starts the local Kafka broker (if it is not running), records a few example multi-turn rollouts
through the SDK — LLM calls whose prompts grow turn by turn, a tool call, a retry branch that
rewinds the context, milestone and final rewards — and reads them back from ``rollout.events``
with the same decoder ``rollstream tail`` uses, showing how little of each prompt went on the
wire (the context trie sends only the new tokens).
"""

from __future__ import annotations

import time
import uuid

import numpy as np
from rich.console import Console
from rich.table import Table

from rollstream.producers import Recorder, RecorderSettings
from rollstream.schemas import Codec

from . import stack, tail

__all__ = ["DemoSettings", "record_examples", "run"]


class DemoSettings(stack.StackSettings):
    demo_rollouts: int = 4
    demo_turns: int = 4


def record_examples(recorder: Recorder, rollouts: int, turns: int, run_id: str) -> list[str]:
    """Write example rollouts with synthetic token IDs; returns their rollout ids."""
    rng = np.random.default_rng(0)
    ids = []
    for i in range(rollouts):
        with recorder.rollout(task_id=f"demo-task-{i % 2}", group_id=f"{run_id}-g{i % 2}",
                              harness="demo", metadata={"run": run_id}) as r:
            ids.append(r.rollout_id)
            prompt = rng.integers(10, 500, 40).astype(np.uint32)  # system + user message
            for turn in range(turns):
                completion = rng.integers(10, 500, 20).astype(np.uint32)
                logprobs = -rng.random(20).astype(np.float32)
                call_id = r.llm_call(prompt, completion, logprobs, model="demo-model")
                result = f"tool result {turn}"
                r.tool_call("calculator", arguments='{"expr": "6*7"}', result=result,
                            at_call_id=call_id)
                r.reward(0.25, kind="milestone", name=f"turn-{turn}", at_call_id=call_id)
                tool_tokens = rng.integers(10, 500, 10).astype(np.uint32)
                prompt = np.concatenate([prompt, completion, tool_tokens])
                if turn == 1 and i % 2 == 0:
                    # retry: go back to the prompt before the last tool result
                    r.branch("retry", source_call_id=call_id, reason="tool said try again")
                    prompt = prompt[: len(prompt) - len(tool_tokens)]
            r.reward(float(i % 2), kind="final", name="tests-pass")
    return ids


def run(settings: DemoSettings) -> int:
    console = Console()
    t0 = time.monotonic()
    with console.status("starting the local Kafka broker ..."):
        stack.up(settings)
    console.print(f"[green]kafka ready[/] at {settings.kafka_bootstrap} "
                  f"({time.monotonic() - t0:.1f}s)")

    run_id = f"demo-{uuid.uuid4().hex[:6]}"
    recorder = Recorder(RecorderSettings(**settings.model_dump(include=set(
        RecorderSettings.model_fields) & set(DemoSettings.model_fields))))
    rollout_ids = record_examples(recorder, settings.demo_rollouts, settings.demo_turns, run_id)
    recorder.close()
    stats = recorder.stats
    console.print(f"recorded {len(rollout_ids)} rollouts: {stats}")

    wanted = set(rollout_ids)
    table = Table("rollout", "events", "llm calls", "prompt tokens", "sent as delta", "rewards",
                  "status", title="read back from rollout.events")
    rows: dict[str, dict[str, int | str]] = {
        rid: {"events": 0, "calls": 0, "prompt": 0, "delta": 0, "rewards": 0, "status": "-"}
        for rid in rollout_ids}
    expected = None
    codec = Codec()
    opts = tail.TailOptions("events", from_beginning=True, idle_timeout=10.0)
    seen = 0
    for rec in tail.records(settings, opts):
        rid = rec.get("rollout_id")
        if rid not in wanted:
            continue
        seen += 1
        row = rows[rid]
        row["events"] = int(row["events"]) + 1
        body = rec["body"]
        if rec["type"] == "LlmCall":
            row["calls"] = int(row["calls"]) + 1
            row["prompt"] = int(row["prompt"]) + body["prefix_len"] + len(body["prompt_delta"])
            row["delta"] = int(row["delta"]) + len(body["prompt_delta"])
        elif rec["type"] == "Reward":
            row["rewards"] = int(row["rewards"]) + 1
        elif rec["type"] == "RolloutFinished":
            row["status"] = body["status"]
        if expected is None:
            expected = stats.sent
        if seen >= expected:
            break
    del codec
    for rid, row in rows.items():
        table.add_row(rid[-10:], *(str(row[k]) for k in
                                    ("events", "calls", "prompt", "delta", "rewards", "status")))
    console.print(table)
    console.print("tail them yourself: [bold]rollstream tail events --from-beginning[/]; "
                  "stop the broker: [bold]rollstream down[/]")
    return 0 if seen == stats.sent else 1
