"""The simulator's workloads: one RL run's cluster, rollouts, training and async knobs.

    Workload                    a pydantic dataclass, every field bounded (WorkloadError
                                names a bad one); ``to_json`` / ``workload_from_json``
    WORKLOADS                   the built-in ones, by name: one shaped like each published
                                setting the simulator is calibrated against, and this_machine
    get_workload(name)          a built-in one
    workload_from_json(data)    {"base": NAME, ...overrides} or a full object

Units. An *accelerator* is the unit of capacity that moves between inference and training (a
GPU, a node, one CPU process: the workload says). Generation is a fluid model per inference
accelerator: with b sequences decoding on it, it makes ``peak_tokens_per_s * b / (b +
half_batch)`` tokens/s, shared evenly, so one sequence runs at ``peak / (b + half_batch)``: a
lone sequence is latency-bound (peak / half_batch), a full batch throughput-bound. At most
``max_seqs_per_accelerator`` sequences decode at once (KV cache); more wait.

A rollout is ``turns`` turns of (generate tokens, then environment time: tool calls, sandbox,
reward). Tokens per turn are lognormal (median, sigma), cut at ``tokens_max`` (the response
length limit); environment times are lognormal with a Pareto tail (probability
``env_tail_p``), cut at ``env_max_s`` (a timeout). After its last turn a rollout takes
``rollout_overhead_s`` more (stage hand-offs, sandbox, evaluation, event posts; 0: none)
before it counts as finished; it holds its slot meanwhile. Rollouts come in GRPO groups of
``group_size``; a group's samples are usable when its last rollout ends. A trainer step takes
``groups_per_step`` groups and lasts ``train_fixed_s + train_step_s * (N / n) **
train_scaling`` on n of the N accelerators.

The paper workloads are simulated at a fraction of the paper's cluster and batch
(``paper_scale``): per-accelerator load is the same, so the fluid model's times are too, and a
run takes milliseconds; docs/simulator.md lists each parameter and where it comes from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Annotated, Any, Final

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from rollstream.consumers.control.errors import WorkloadError

__all__ = ["WORKLOADS", "Workload", "WorkloadError", "get_workload", "workload_from_json"]

Count = Annotated[int, Field(ge=1, le=1_000_000)]
Seconds = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, le=1e9, allow_inf_nan=False)]
Sigma = Annotated[float, Field(ge=0, le=5, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class Workload:
    """One simulated RL run (module docstring)."""

    name: Annotated[str, Field(pattern=r"^[a-z0-9_]{1,64}$")]
    description: Annotated[str, Field(max_length=500)] = ""
    # cluster and batch
    accelerators: Annotated[int, Field(ge=2, le=100_000)] = 8  # N
    groups_per_step: Count = 16  # prompts per trainer step
    group_size: Annotated[int, Field(ge=1, le=1024)] = 8  # rollouts per prompt (GRPO n)
    samples_per_rollout: Annotated[int, Field(ge=1, le=1024)] = 1
    # generation, per inference accelerator
    peak_tokens_per_s: Positive = 5000.0
    half_batch: Positive = 32.0
    max_seqs_per_accelerator: Count = 256
    rollout_slots: Annotated[int, Field(ge=0, le=10_000_000)] = 0  # RUN capacity; 0: KV slots
    # rollout shape
    turns_min: Count = 1
    turns_max: Count = 1
    tokens_median: Positive = 1000.0
    tokens_sigma: Sigma = 0.5
    tokens_max: Annotated[int, Field(ge=1, le=10_000_000)] = 8192
    env_median_s: Seconds = 0.0  # 0: no environment time
    env_sigma: Sigma = 0.5
    env_tail_p: Fraction = 0.0
    env_tail_scale_s: Seconds = 0.0
    env_tail_alpha: Annotated[float, Field(gt=0.5, le=10, allow_inf_nan=False)] = 1.5
    env_max_s: Seconds = 3600.0
    rollout_overhead_s: Seconds = 0.0  # per rollout, after its last turn
    # training
    train_step_s: Positive = 60.0  # one step on all N accelerators
    train_fixed_s: Seconds = 0.0
    train_scaling: Fraction = 1.0  # 1: linear in accelerators, 0: no gain from more
    recompute_logprobs_s: Seconds = 0.0  # collocated policies' extra pass (on all N)
    switch_s: Seconds = 5.0  # collocated: switch the pool between roles, per step
    weight_sync_s: Seconds = 5.0  # separate pools: push new weights to inference
    reshard_s: Seconds = 10.0  # move accelerators between roles
    interrupt_tokens: Seconds = 0.0  # partial rollouts: re-prefill, in tokens, per sequence
    # asynchrony
    max_staleness: Annotated[int, Field(ge=0, le=1000)] = 2  # eta: staler samples dropped
    admission_ahead_steps: Annotated[float, Field(ge=0, le=1000)] | None = None  # fully_async
    inference_share: Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)] = 0.5
    async_groups: Annotated[int, Field(ge=0, le=1_000_000)] = 0  # collocated_async; 0: 2 x
    train_minibatches: Annotated[int, Field(ge=1, le=1024)] = 1  # separate trainer streams
    control_period_s: Annotated[float, Field(gt=0, le=3600)] = 5.0  # rollstream's controller
    control_cooldown_s: Seconds = 30.0
    steps: Annotated[int, Field(ge=1, le=100_000)] = 10  # trainer steps per run (default)
    # provenance
    paper_policy: str | None = None  # the policy the source publishes a speedup for
    published_speedup: Annotated[float, Field(gt=0, le=1000)] | None = None
    paper_scale: Annotated[float, Field(gt=0, le=1e6)] = 1.0  # paper cluster / simulated
    source: Annotated[str, Field(max_length=500)] = ""

    def __post_init__(self) -> None:
        if self.turns_min > self.turns_max:
            raise ValueError(f"turns_min {self.turns_min} > turns_max {self.turns_max}")

    @property
    def samples_per_step(self) -> int:
        return self.groups_per_step * self.group_size * self.samples_per_rollout

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> Workload:
        """A copy with ``changes`` applied (validated)."""
        return workload_from_json({**self.to_json(), **changes})

    def scaled(self, factor: float) -> Workload:
        """The same workload on ``factor`` times the accelerators and batch (rounded)."""
        return self.replace(
            accelerators=max(2, round(self.accelerators * factor)),
            groups_per_step=max(1, round(self.groups_per_step * factor)),
            async_groups=round(self.async_groups * factor),
            rollout_slots=round(self.rollout_slots * factor),
            paper_scale=self.paper_scale / factor,
        )


_ADAPTER: Final = TypeAdapter(Workload)


def workload_from_json(data: Any) -> Workload:
    """A workload from a JSON object: ``{"base": NAME, ...}`` overrides a built-in one."""
    if not isinstance(data, Mapping):
        raise WorkloadError(f"a workload is a JSON object, not {type(data).__name__}")
    fields = dict(data)
    base = fields.pop("base", None)
    if base is not None:
        fields = {**get_workload(str(base)).to_json(), **fields}
    try:
        return _ADAPTER.validate_python(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "workload"
        raise WorkloadError(first["msg"], field=where) from exc


def get_workload(name: str) -> Workload:
    """The built-in workload ``name`` (WORKLOADS)."""
    try:
        return WORKLOADS[name]
    except KeyError:
        known = ", ".join(sorted(WORKLOADS))
        raise WorkloadError(f"unknown workload {name!r} (known: {known})", field="name") from None


# The parameters and their sources: docs/simulator.md. "fitted": chosen so that the simulated
# speedup of the paper's policy over sync lands on the published figure.
_QWENGYRE_A: Final = Workload(
    name="qwengyre_a",
    description="xLong-horizon agent (10-30 turns of long generation and tool calls, "
    "latency-bound decoding); elastic rollout/train split between phases, setting A",
    accelerators=16,
    groups_per_step=8,
    group_size=4,
    peak_tokens_per_s=64000.0,
    half_batch=256.0,
    max_seqs_per_accelerator=32,
    turns_min=10,
    turns_max=30,
    tokens_median=5000.0,
    tokens_sigma=0.6,
    tokens_max=16384,
    env_median_s=8.0,
    env_sigma=0.8,
    env_tail_p=0.03,
    env_tail_scale_s=60.0,
    env_tail_alpha=1.5,
    env_max_s=900.0,
    train_step_s=1400.0,
    switch_s=30.0,
    weight_sync_s=10.0,
    reshard_s=10.0,
    max_staleness=2,
    inference_share=0.5,
    control_period_s=10.0,
    control_cooldown_s=120.0,
    steps=16,
    paper_policy="elastic",
    published_speedup=1.85,
    paper_scale=1.0,
    source="QwenGyre (xLong-horizon agentic RL; elastic rollout/training split)",
)


WORKLOADS: Final[dict[str, Workload]] = {
    w.name: w
    for w in (
        Workload(
            name="agent_lightning",
            description="coding agent in a real harness, multi-turn with sandbox tool calls; "
            "collocated async (B_async = 2 B_train)",
            accelerators=8,
            groups_per_step=32,
            group_size=4,
            peak_tokens_per_s=3000.0,
            half_batch=16.0,
            max_seqs_per_accelerator=64,
            turns_min=4,
            turns_max=16,
            tokens_median=500.0,
            tokens_sigma=0.8,
            tokens_max=4096,
            env_median_s=4.0,
            env_sigma=1.0,
            env_tail_p=0.05,
            env_tail_scale_s=30.0,
            env_tail_alpha=1.3,
            env_max_s=600.0,
            train_step_s=450.0,
            switch_s=15.0,
            weight_sync_s=10.0,
            reshard_s=20.0,
            max_staleness=4,
            inference_share=0.5,
            async_groups=64,
            control_period_s=5.0,
            control_cooldown_s=60.0,
            steps=10,
            paper_policy="collocated_async",
            published_speedup=2.0,
            paper_scale=1.0,
            source="Agent Lightning v1.0 (arXiv 2608.17528; docs/35-asynchronous-training.md)",
        ),
        _QWENGYRE_A,
        replace(
            _QWENGYRE_A,
            name="qwengyre_b",
            description="xLong-horizon agent as qwengyre_a, setting B: longer and "
            "heavier-tailed environment phases, longer training steps",
            env_median_s=12.0,
            env_tail_p=0.05,
            train_step_s=1800.0,
            published_speedup=1.78,
        ),
        Workload(
            name="areal",
            description="math reasoning, single turn, long generation tails (up to 32K "
            "tokens); fully async with interruptible rollouts, 3:1 inference:training",
            accelerators=16,
            groups_per_step=32,
            group_size=16,
            peak_tokens_per_s=9000.0,
            half_batch=64.0,
            max_seqs_per_accelerator=64,
            tokens_median=3000.0,
            tokens_sigma=1.0,
            tokens_max=32000,
            env_median_s=1.0,
            env_sigma=0.5,
            train_step_s=24.0,
            switch_s=10.0,
            weight_sync_s=5.0,
            reshard_s=20.0,
            interrupt_tokens=200.0,
            max_staleness=8,
            inference_share=0.75,
            control_period_s=5.0,
            control_cooldown_s=60.0,
            steps=12,
            paper_policy="fully_async",
            published_speedup=2.77,
            paper_scale=16.0,
            source="AReaL (arXiv 2505.24298, abstract and Section 7)",
        ),
        Workload(
            name="verl_fully_async",
            description="DAPO math (Qwen2.5-Math-7B, 28K max response), 128 GPUs and 512 "
            "prompts per step at 1/8 scale; separate 64:64 rollouter/trainer, stale samples, "
            "partial rollout",
            accelerators=16,
            groups_per_step=64,
            group_size=16,
            peak_tokens_per_s=4500.0,
            half_batch=32.0,
            max_seqs_per_accelerator=256,
            tokens_median=1100.0,
            tokens_sigma=0.9,
            tokens_max=28000,
            env_median_s=1.0,
            env_sigma=0.5,
            train_step_s=114.0,
            train_scaling=0.0,
            recompute_logprobs_s=54.0,
            switch_s=10.0,
            weight_sync_s=5.0,
            reshard_s=20.0,
            interrupt_tokens=200.0,
            max_staleness=2,
            admission_ahead_steps=0.5,
            inference_share=0.5,
            train_minibatches=4,
            control_period_s=5.0,
            control_cooldown_s=60.0,
            steps=12,
            paper_policy="fully_async",
            published_speedup=2.35,
            paper_scale=8.0,
            source="verl fully_async_policy recipe README, 'Asynchronous Training on 7B "
            "Model' table (128 cards)",
        ),
        Workload(
            name="this_machine",
            description="the local stack on one CPU box (the demo: 4 tasks x 8 rollouts, 2 "
            "turns of 12 tokens, 8 RUN slots, one inference process, one trainer); the "
            "defaults are rough: calibrate them with measured figures (--workload FILE.json)",
            accelerators=2,
            groups_per_step=4,
            group_size=8,
            peak_tokens_per_s=30000.0,
            half_batch=24.0,
            max_seqs_per_accelerator=64,
            rollout_slots=8,
            turns_min=2,
            turns_max=2,
            tokens_median=12.0,
            tokens_sigma=0.1,
            tokens_max=12,
            env_median_s=0.5,
            env_sigma=1.0,
            env_max_s=60.0,
            train_step_s=2.0,
            train_fixed_s=6.0,
            switch_s=1.0,
            weight_sync_s=3.0,
            reshard_s=5.0,
            max_staleness=2,
            inference_share=0.5,
            control_period_s=2.0,
            control_cooldown_s=10.0,
            steps=12,
            source="rollstream's demo (infra/demo); parameters are inputs",
        ),
    )
}
