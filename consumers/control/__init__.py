"""rollstream.consumers.control: the elastic controller's policy, the controller that runs it
live, and the simulator that plans it at cluster scale.

    policy.py           Signals, PolicyConfig, Decision, admission_headroom, decide: the one
                        policy (staleness-aware admission and the inference/training split)
                        shared by the live controller and the simulator; pure
    controller.py       ``rollstream controller``: reads the log, decides, publishes
    signals.py          from the log's records to Signals, from a Decision to the record
    sim.py              simulate / compare: a discrete-event model of an RL run under sync,
                        collocated async (Agent Lightning), fully async (AReaL, verl),
                        elastic (QwenGyre) and rollstream's policy; pure
    sim_engine.py       its clock, fluid inference pool, rollouts and counters; pure
    sim_policies.py     the published systems as simulated drivers; pure
    sim_rollstream.py   rollstream's policy as a simulated driver; pure
    sim_workloads.py    the workloads (one per published setting, and this_machine); pure
    simulate_cli.py     ``rollstream simulate``: tables and a plot
    errors.py           ControlError (a ConsumerError), WorkloadError

docs/simulator.md describes the model, the workloads and their sources, and the results.
"""

from rollstream.consumers.control.errors import ControlError, WorkloadError
from rollstream.consumers.control.policy import (
    REASONS,
    Decision,
    PolicyConfig,
    Signals,
    admission_headroom,
    decide,
    rollout_budget,
)
from rollstream.consumers.control.sim import (
    POLICY_NAMES,
    PolicySummary,
    SimResult,
    compare,
    simulate,
)
from rollstream.consumers.control.sim_workloads import (
    WORKLOADS,
    Workload,
    get_workload,
    workload_from_json,
)

__all__ = [
    "POLICY_NAMES",
    "REASONS",
    "WORKLOADS",
    "ControlError",
    "Decision",
    "PolicyConfig",
    "PolicySummary",
    "Signals",
    "SimResult",
    "Workload",
    "WorkloadError",
    "admission_headroom",
    "compare",
    "decide",
    "get_workload",
    "rollout_budget",
    "simulate",
    "workload_from_json",
]
