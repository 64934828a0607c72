"""The simulator's machinery: a discrete-event loop (heapq), the inference pool (a fluid model
of continuous batching), rollouts and GRPO groups, and the run's counters. The policies
(sim_policies.py) drive it; sim.py is the public face.

    Engine(workload, seed)        the clock, the events, the rollouts, the counters
      .at / .after                schedule a callback
      .start_rollout(version)     one rollout, in the open GRPO group (a new one when full);
                                  its shape is drawn in start order
      .running / .in_flight       rollouts not finished / rollouts whose group's samples are
                                  not out yet (a group's samples come out when it completes)
      .pool                       the inference accelerators (Pool)
    Pool                          sequences decoding at peak * n / (active + half_batch * n)
                                  tokens/s each; hold (no new requests), drain, freeze (weight
                                  load), interrupt (partial rollouts pay a re-prefill)

Randomness: a rollout's shape (turns, tokens and environment time per turn) is drawn when it
starts from one ``random.Random(seed)`` stream, so the k-th rollout of every policy has the same
shape (common random numbers: speedups compare like with like). Events at the same time run in
the order they were scheduled. Pure: no I/O.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Final, Protocol

from rollstream.consumers.control.errors import ControlError
from rollstream.consumers.control.sim_workloads import Workload

__all__ = ["Engine", "Policy", "Pool"]

MAX_EVENTS: Final = 50_000_000
_EPS: Final = 1e-9


class Policy(Protocol):
    """What the engine calls back: a rollout that ended (a RUN slot is free), then, when it
    was the group's last, the group."""

    def on_rollout_done(self) -> None: ...

    def on_group_done(self, group: int) -> None: ...


class Pool:
    """The inference accelerators: a fluid processor-sharing model (module docstring)."""

    def __init__(self, engine: Engine, n: float) -> None:
        w = engine.workload
        self.engine = engine
        self.n = n  # accelerators serving inference
        self.peak = w.peak_tokens_per_s
        self.half = w.half_batch
        self.per_accelerator = w.max_seqs_per_accelerator
        self.v = 0.0  # tokens each decoding sequence has made since the start (virtual time)
        self.t = 0.0
        self.active: list[tuple[float, int]] = []  # heap of (finish v, rollout)
        self.queue: deque[tuple[int, float]] = deque()  # waiting for a KV slot
        self.held: list[tuple[int, float]] = []  # new requests while held
        self.holding = False
        self.frozen = False
        self.epoch = 0
        self._due = math.inf  # time of the pending finish event of this epoch
        self._k = self.peak * n  # rate = _k / (active + _h)
        self._h = self.half * n
        self._cap = max(1, math.floor(self.per_accelerator * n + _EPS))
        self.on_drained: Callable[[], None] | None = None
        self.served_version = 0
        self.busy_s = 0.0  # accelerator-seconds with a sequence decoding
        self.demand_s = 0.0  # sequence-seconds decoding or waiting for a KV slot
        self.tokens = 0.0

    # -- the fluid model -----------------------------------------------------------------------
    def rate(self) -> float:
        """Tokens/s of one decoding sequence now."""
        a = len(self.active)
        if a == 0 or self.n <= 0 or self.frozen:
            return 0.0
        return self._k / (a + self._h)

    def utilisation(self) -> float:
        """Throughput over peak: b / (b + half_batch), b sequences per accelerator."""
        if self.n <= 0 or self.frozen:
            return 0.0
        b = len(self.active) / self.n
        return b / (b + self.half)

    def capacity(self) -> int:
        return self._cap

    def _advance(self) -> None:
        now = self.engine.now
        dt = now - self.t
        if dt > 0:
            a = len(self.active)
            self.demand_s += (a + len(self.queue)) * dt
            if a and self.n > 0 and not self.frozen:
                r = self._k / (a + self._h)
                self.v += r * dt
                self.busy_s += (a if a < self.n else self.n) * dt
                self.tokens += r * a * dt
        self.t = now

    def _schedule(self) -> None:
        """Make sure a finish event fires no later than the next sequence ends. A pending one
        that fires earlier is kept (it re-checks); a later one is replaced."""
        r = self.rate()
        if r <= 0:
            self.epoch += 1
            self._due = math.inf
            return
        ahead = (self.active[0][0] - self.v) / r
        due = self.engine.now + (ahead if ahead > 0 else 0.0)
        if due < self._due:
            self.epoch += 1
            self._due = due
            self.engine.at(due, self._on_finish, self.epoch)

    def _fill(self) -> None:
        cap = self._cap
        while self.queue and len(self.active) < cap:
            rollout, tokens = self.queue.popleft()
            heapq.heappush(self.active, (self.v + tokens, rollout))

    def _on_finish(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self._due = math.inf
        self._advance()
        done = []
        while self.active and self.active[0][0] <= self.v + 1e-6:
            done.append(heapq.heappop(self.active)[1])
        if not self.holding:
            self._fill()
        self._schedule()
        for rollout in done:
            self.engine.gen_done(rollout)
        if not self.active and self.on_drained is not None:
            then, self.on_drained = self.on_drained, None
            then()

    # -- what the policies do ------------------------------------------------------------------
    def submit(self, rollout: int, tokens: float) -> None:
        """A generation request of ``tokens`` tokens."""
        if self.holding:
            self.held.append((rollout, tokens))
            return
        self._advance()
        self.queue.append((rollout, tokens))
        self._fill()
        self._schedule()

    def set_accelerators(self, n: float) -> None:
        self._advance()
        self.n = n
        self._k = self.peak * n
        self._h = self.half * n
        self._cap = max(1, math.floor(self.per_accelerator * n + _EPS))
        if not self.holding:
            self._fill()
        self._reschedule()

    def _reschedule(self) -> None:
        """The rate went up (or the sequences changed): forget the pending event."""
        self.epoch += 1
        self._due = math.inf
        self._schedule()

    def hold(self) -> None:
        """New requests wait (those decoding go on)."""
        self.holding = True

    def drain(self, then: Callable[[], None]) -> None:
        """Hold new requests; ``then`` runs when nothing decodes any more."""
        self.hold()
        if not self.active:
            then()
        else:
            self.on_drained = then

    def release(self) -> None:
        """Held requests (and the queue) go on."""
        self._advance()
        self.holding = False
        self.queue.extend(self.held)
        self.held = []
        self._fill()
        self._schedule()

    def freeze(self, seconds: float, then: Callable[[], None]) -> None:
        """Nothing decodes for ``seconds`` (weights load); then ``then``."""
        self._advance()
        self.frozen = True
        self._reschedule()

        def thaw() -> None:
            self._advance()
            self.frozen = False
            self._reschedule()
            then()

        self.engine.after(seconds, thaw)

    def interrupt(self, extra_tokens: float) -> int:
        """Every decoding sequence pays ``extra_tokens`` (its KV cache is recomputed with the
        new weights); returns how many were interrupted."""
        self._advance()
        if extra_tokens > 0 and self.active:
            self.active = [(v + extra_tokens, r) for v, r in self.active]  # still a heap
            self._reschedule()
        return len(self.active)


class Engine:
    """The clock, the events, the rollouts and the counters of one simulated run."""

    def __init__(self, workload: Workload, seed: int, inference_accelerators: float) -> None:
        self.workload = workload
        self.now = 0.0
        self.rng = random.Random(seed)
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self.events = 0
        self.stopped = False
        self.policy: Policy | None = None
        self.pool = Pool(self, inference_accelerators)
        # rollouts (by index) and groups (by index)
        self.r_group: list[int] = []
        self.r_turns: list[deque[tuple[float, float]]] = []  # (tokens, env seconds) left
        self.r_start: list[float] = []
        self.g_version: list[int] = []  # the weights of its first (oldest) rollout
        self.g_left: list[int] = []
        self._open_left = 0  # rollouts the open group still takes
        # counters (in rollouts unless named otherwise)
        self.rollouts_started = 0
        self.rollouts_finished = 0
        self.rollouts_emitted = 0  # in groups that completed
        self.groups_done = 0
        self.rollout_time_sum = 0.0
        self.rollouts_trained = 0
        self.rollouts_wasted = 0
        self.staleness: Counter[int] = Counter()  # samples by staleness
        self.train_busy_s = 0.0  # accelerator-seconds training
        self.steps = 0
        self.step_ends: list[float] = []  # when each trainer step ended
        self.share_area = 0.0  # integral of the inference share over time
        self._share_t = 0.0

    # -- events --------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn, args))

    def after(self, dt: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, policy: Policy, start: Callable[[], None]) -> None:
        """Run ``start`` then the events until ``stop``; a run whose events run out stalled."""
        self.policy = policy
        start()
        events = self._events
        while not self.stopped:
            if not events:
                raise ControlError(f"the simulation stalled at t={self.now:.1f}s (a policy bug)")
            t, _, fn, args = heapq.heappop(events)
            self.now = t
            fn(*args)
            self.events += 1
            if self.events > MAX_EVENTS:
                raise ControlError(f"more than {MAX_EVENTS} events: the run is too long")

    def stop(self) -> None:
        self.note_share()
        self.stopped = True

    def note_share(self) -> None:
        """Accumulate the inference share up to now (call before the split changes)."""
        n = self.workload.accelerators
        self.share_area += (self.now - self._share_t) * self.pool.n / n
        self._share_t = self.now

    # -- rollouts ------------------------------------------------------------------------------
    def _shape(self) -> deque[tuple[float, float]]:
        w, rng = self.workload, self.rng
        turns = rng.randint(w.turns_min, w.turns_max)
        mu_tokens = math.log(w.tokens_median)
        mu_env = math.log(w.env_median_s) if w.env_median_s > 0 else 0.0
        shape: deque[tuple[float, float]] = deque()
        gauss, exp = rng.gauss, math.exp
        for _ in range(turns):
            tokens = min(float(w.tokens_max), max(1.0, exp(gauss(mu_tokens, w.tokens_sigma))))
            env = 0.0
            if w.env_tail_p > 0 and rng.random() < w.env_tail_p:
                env = w.env_tail_scale_s * rng.paretovariate(w.env_tail_alpha)
            elif w.env_median_s > 0:
                env = exp(gauss(mu_env, w.env_sigma))
            shape.append((tokens, min(env, w.env_max_s)))
        return shape

    @property
    def running(self) -> int:
        return self.rollouts_started - self.rollouts_finished

    @property
    def in_flight(self) -> int:
        return self.rollouts_started - self.rollouts_emitted

    def start_rollout(self, version: int) -> None:
        """Start a rollout with weights ``version`` in the open group (a new one when full)."""
        if self._open_left == 0:
            self.g_version.append(version)
            self.g_left.append(self.workload.group_size)
            self._open_left = self.workload.group_size
        self._open_left -= 1
        rollout = len(self.r_group)
        self.r_group.append(len(self.g_version) - 1)
        turns = self._shape()
        self.r_turns.append(turns)
        self.r_start.append(self.now)
        self.rollouts_started += 1
        self.pool.submit(rollout, turns[0][0])

    def gen_done(self, rollout: int) -> None:
        _, env = self.r_turns[rollout].popleft()
        if env > 0:
            self.after(env, self._env_done, rollout)
        else:
            self._env_done(rollout)

    def _env_done(self, rollout: int) -> None:
        turns = self.r_turns[rollout]
        if turns:
            self.pool.submit(rollout, turns[0][0])
            return
        overhead = self.workload.rollout_overhead_s
        if overhead > 0:
            self.after(overhead, self._finish, rollout)
        else:
            self._finish(rollout)

    def _finish(self, rollout: int) -> None:
        self.rollouts_finished += 1
        self.rollout_time_sum += self.now - self.r_start[rollout]
        group = self.r_group[rollout]
        self.g_left[group] -= 1
        assert self.policy is not None
        if self.g_left[group] == 0:
            self.groups_done += 1
            self.rollouts_emitted += self.workload.group_size
            self.policy.on_rollout_done()
            self.policy.on_group_done(group)
        else:
            self.policy.on_rollout_done()

    # -- training ------------------------------------------------------------------------------
    def train_seconds(self, n: float, *, recompute: bool = False) -> float:
        """One whole step on ``n`` accelerators (collocated policies add the logprob pass)."""
        w = self.workload
        n = max(n, _EPS)
        scale = (w.accelerators / n) ** w.train_scaling
        compute = w.train_step_s + (w.recompute_logprobs_s if recompute else 0.0)
        return w.train_fixed_s + compute * scale

    def trained(self, groups: list[int], version: int) -> None:
        """``groups`` trained at step ``version`` (weights ``version``)."""
        per_group = self.workload.group_size * self.workload.samples_per_rollout
        for g in groups:
            self.staleness[version - self.g_version[g]] += per_group
        self.rollouts_trained += len(groups) * self.workload.group_size

    def wasted(self, groups: list[int]) -> None:
        self.rollouts_wasted += len(groups) * self.workload.group_size

    def mean_rollout_time(self) -> float:
        return self.rollout_time_sum / self.rollouts_finished if self.rollouts_finished else 0.0
