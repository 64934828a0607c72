"""The simulated RL systems, each driving the engine (sim_engine.py) its own way.

    sync              strictly on-policy, collocated: generate a batch of groups on all N
                      accelerators, wait for every rollout, switch the pool to training, train,
                      switch back (weights are local), repeat. Every sample has staleness 0.
    collocated_async  Agent Lightning v1.0: one pool; up to ``async_groups`` groups active;
                      when ``groups_per_step`` groups are complete: hold new model requests,
                      drain the ones decoding, train on the whole pool, resume. Environment
                      time overlaps training; unfinished groups carry over (no staleness bound).
    fully_async       AReaL / verl fully async: a fixed split (``inference_share``), rollouts
                      generated continuously, admitted while started - dropped <= (V + 1 +
                      ahead) * B (AReaL's rule; ahead = ``admission_ahead_steps`` or eta); the
                      trainer streams ``train_minibatches`` chunks per step, drops samples
                      staler than eta; weight updates interrupt decoding sequences, which
                      continue with the new weights after a re-prefill (partial rollouts).
    elastic           QwenGyre as modelled here: one-step off-policy phases (batch k + 1 is
                      generated while batch k trains, staleness <= 1); between phases the split
                      follows the load: inference keeps the accelerators its sequences keep
                      busy (D / ``half_batch``, so each runs at half its peak or more; D the
                      mean sequences decoding or waiting to in the last phase) and that hold
                      a phase's rollouts at once (``max_seqs_per_accelerator`` each); training
                      takes the rest; within a phase
                      the side that finishes first lends its accelerators to the other.

rollstream and rollstream_partial (fully async driven by ``policy.decide``) are in
sim_rollstream.py; the registry of names is sim.POLICIES.

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections import deque

from rollstream.consumers.control.sim_engine import Engine

__all__ = ["CollocatedAsync", "Driver", "Elastic", "FullyAsync", "Sync"]


class Driver:
    """A simulated system: ``start`` it; the engine calls ``on_rollout_done`` (a RUN slot is
    free) and ``on_group_done`` (a group's samples are out)."""

    def __init__(self, engine: Engine, steps: int) -> None:
        self.e = engine
        self.w = engine.workload
        self.target = steps
        self.n = engine.workload.accelerators
        self.version = 0  # the trainer's newest version
        self.per_step = engine.workload.groups_per_step * engine.workload.group_size  # rollouts

    def start(self) -> None:
        raise NotImplementedError

    def on_rollout_done(self) -> None:
        self.fill()

    def on_group_done(self, group: int) -> None:
        raise NotImplementedError

    def fill(self) -> None:
        """Start the rollouts the policy allows now."""

    def waiting_groups(self) -> int:
        """Groups complete and not trained (nor dropped) when the run ends."""
        return 0

    def slots_max(self) -> int:
        """Rollouts that may run at once: the RUN slots, else the decoding (KV) slots."""
        if self.w.rollout_slots > 0:
            return self.w.rollout_slots
        return self.e.pool.capacity()

    def _step_done(self) -> bool:
        self.version += 1
        self.e.steps += 1
        self.e.step_ends.append(self.e.now)
        if self.e.steps >= self.target:
            self.e.stop()
            return True
        return False


class _Rounds(Driver):
    """A driver that generates in rounds: ``_to_start`` rollouts of the round are still to
    start; ``fill`` starts them while RUN slots are free."""

    _to_start: int

    def fill(self) -> None:
        slots = self.slots_max()
        while self._to_start > 0 and self.e.running < slots:
            self.e.start_rollout(self.version)
            self._to_start -= 1


class Sync(_Rounds):
    def start(self) -> None:
        self._begin()

    def _begin(self) -> None:
        self._batch: list[int] = []
        self._to_start = self.per_step
        self.fill()

    def on_group_done(self, group: int) -> None:
        self._batch.append(group)
        if len(self._batch) == self.w.groups_per_step:
            self.e.note_share()
            self.e.pool.set_accelerators(0)
            seconds = self.e.train_seconds(self.n, recompute=True)
            self.e.train_busy_s += self.n * seconds
            self.e.after(self.w.switch_s + seconds, self._trained)

    def _trained(self) -> None:
        self.e.trained(self._batch, self.version)
        if self._step_done():
            return
        self.e.note_share()
        self.e.pool.set_accelerators(self.n)
        self.e.pool.served_version = self.version
        self._begin()


class CollocatedAsync(Driver):
    def start(self) -> None:
        groups = self.w.async_groups or 2 * self.w.groups_per_step
        self._limit = groups * self.w.group_size  # rollouts active: started, not consumed
        self._consumed = 0
        self._completed: deque[int] = deque()
        self._updating = False
        self.fill()

    def fill(self) -> None:
        e, slots = self.e, self.slots_max()
        while e.rollouts_started - self._consumed < self._limit and e.running < slots:
            e.start_rollout(self.version)

    def on_group_done(self, group: int) -> None:
        self._completed.append(group)
        self._maybe_update()

    def _maybe_update(self) -> None:
        if not self._updating and len(self._completed) >= self.w.groups_per_step:
            self._updating = True
            self.e.pool.drain(self._train)

    def _train(self) -> None:
        self.e.note_share()
        self.e.pool.set_accelerators(0)
        seconds = self.e.train_seconds(self.n, recompute=True)
        self.e.train_busy_s += self.n * seconds
        self.e.after(self.w.switch_s + seconds, self._trained)

    def _trained(self) -> None:
        batch = [self._completed.popleft() for _ in range(self.w.groups_per_step)]
        self.e.trained(batch, self.version)
        self._consumed += self.per_step
        if self._step_done():
            return
        self.e.note_share()
        self.e.pool.set_accelerators(self.n)
        self.e.pool.served_version = self.version
        self.e.pool.release()
        self._updating = False
        self.fill()
        self._maybe_update()

    def waiting_groups(self) -> int:
        return len(self._completed)


class FullyAsync(Driver):
    """Separate inference and training accelerators (also the base of rollstream)."""

    interrupt = True  # weight updates interrupt decoding (partial rollouts); False: drain

    def start(self) -> None:
        n_inf = min(max(round(self.w.inference_share * self.n), 1), self.n - 1)
        self.e.pool.set_accelerators(n_inf)
        self.n_train: float = self.n - n_inf
        self._buffer: deque[int] = deque()
        self._taken = 0  # groups the step in progress took
        self._chunk = math.ceil(self.w.groups_per_step / self.w.train_minibatches)
        self._busy = False  # training a chunk or pushing weights
        self._dropped = 0  # rollouts
        self._idle_since: float | None = 0.0
        self.idle_total = 0.0
        self.step_time = 0.0
        self._step_start = 0.0
        self._updating = False
        self._update_again = False
        self.fill()

    # -- admission: AReaL's rule, started - dropped <= (V + 1 + ahead) * B -------------------
    def fill(self) -> None:
        ahead = self.w.admission_ahead_steps
        ahead = self.w.max_staleness if ahead is None else ahead
        limit = math.floor((self.version + 1 + ahead) * self.per_step + 1e-9)
        e, slots = self.e, self.slots_max()
        while e.rollouts_started - self._dropped < limit and e.running < slots:
            e.start_rollout(e.pool.served_version)

    # -- the trainer ---------------------------------------------------------------------------
    def on_group_done(self, group: int) -> None:
        self._buffer.append(group)
        self._try_train()

    def idle_now(self) -> float:
        """Seconds the trainer waited for samples, in all, up to now."""
        since = self._idle_since
        return self.idle_total + (self.e.now - since if since is not None else 0.0)

    def _try_train(self) -> None:
        if self._busy or self.e.stopped:
            return
        eta, versions = self.w.max_staleness, self.e.g_version
        stale = [g for g in self._buffer if self.version - versions[g] > eta]
        if stale:
            self._buffer = deque(g for g in self._buffer if self.version - versions[g] <= eta)
            self.e.wasted(stale)
            self._dropped += len(stale) * self.w.group_size
            self.fill()
        need = min(self._chunk, self.w.groups_per_step - self._taken)
        if len(self._buffer) < need:
            if self._idle_since is None:
                self._idle_since = self.e.now
            return
        if self._idle_since is not None:
            self.idle_total += self.e.now - self._idle_since
            self._idle_since = None
        groups = [self._buffer.popleft() for _ in range(need)]
        self.e.trained(groups, self.version)
        seconds = self.e.train_seconds(self.n_train) * need / self.w.groups_per_step
        self.e.train_busy_s += self.n_train * seconds
        self._busy = True
        self.e.after(seconds, self._chunk_done, need)

    def _chunk_done(self, groups: int) -> None:
        self._busy = False
        self._taken += groups
        self.chunk_boundary()
        if self._taken < self.w.groups_per_step:
            self._try_train()
            return
        self._taken = 0
        self.step_time = self.e.now - self._step_start
        self._step_start = self.e.now
        if self._step_done():
            return
        self._busy = True  # the trainer pushes the weights
        self.e.after(self.w.weight_sync_s, self._pushed)
        self._update_weights()

    def _pushed(self) -> None:
        self._busy = False
        self.new_version()
        self.fill()
        self._try_train()

    def chunk_boundary(self) -> None:
        """Between two chunks (rollstream moves accelerators toward inference here)."""

    def new_version(self) -> None:
        """The trainer published a version (rollstream decides again here)."""

    # -- the inference side of a weight update -------------------------------------------------
    def _update_weights(self) -> None:
        if self._updating:
            self._update_again = True
            return
        self._updating = True
        version, pool = self.version, self.e.pool

        def loaded() -> None:
            pool.served_version = version
            self._updating = False
            if not self.interrupt:
                pool.release()
            if self._update_again:
                self._update_again = False
                self._update_weights()
            self.fill()

        if self.interrupt:
            pool.interrupt(self.w.interrupt_tokens)
            pool.freeze(self.w.weight_sync_s, loaded)
        else:
            pool.drain(lambda: pool.freeze(self.w.weight_sync_s, loaded))

    def waiting_groups(self) -> int:
        return len(self._buffer)


class Elastic(_Rounds):
    def start(self) -> None:
        self._n_inf = min(max(round(self.w.inference_share * self.n), 1), self.n - 1)
        self._generated: list[int] = []  # the batch generated this phase
        self._batches = 1
        self._gen_running = True
        self._train_running = False
        self._has_trained = False
        self._seq_s0 = 0.0
        self._gen_since = 0.0
        self._gen_time = 0.0
        self._train_epoch = 0  # a rescheduled training end makes the older one stale
        self._to_start = self.per_step
        self.fill()

    def on_group_done(self, group: int) -> None:
        self._generated.append(group)
        if len(self._generated) < self.w.groups_per_step:
            return
        self._gen_running = False
        self._gen_time = self.e.now - self._gen_since
        if self._train_running:  # lend the rollout accelerators to training
            lend = self.e.pool.n
            self.e.note_share()
            self.e.pool.set_accelerators(0)
            self.e.after(self.w.reshard_s, self._set_train, lend)
        else:
            self._phase_end()

    # training with a changing number of accelerators: work left as a fraction of the step
    def _begin_train(self, batch: list[int], n: float) -> None:
        self._batch = batch
        self._train_running = True
        self._work_left = 1.0
        self._train_n = n
        self._train_since = self.e.now
        self._schedule_train()

    def _progress(self) -> None:
        full = self.e.train_seconds(self._train_n, recompute=True)
        elapsed = self.e.now - self._train_since
        self._work_left = max(0.0, self._work_left - elapsed / full)
        self.e.train_busy_s += self._train_n * elapsed
        self._train_since = self.e.now

    def _schedule_train(self) -> None:
        self._train_epoch += 1
        full = self.e.train_seconds(self._train_n, recompute=True)
        self.e.after(self._work_left * full, self._train_end, self._train_epoch)

    def _set_train(self, extra: float) -> None:
        if not self._train_running:
            return
        self._progress()
        self._train_n += extra
        self._schedule_train()

    def _train_end(self, epoch: int) -> None:
        if epoch != self._train_epoch:
            return
        self._progress()
        self._train_running = False
        self._has_trained = True
        self.e.trained(self._batch, self.version)
        if self._gen_running:  # lend the training accelerators to the rollouts' tail
            self.e.after(self.w.reshard_s, self._lend_to_rollouts, self._train_n)
        else:
            self._phase_end()

    def _lend_to_rollouts(self, n: float) -> None:
        if self._gen_running:
            self.e.note_share()
            self.e.pool.set_accelerators(self.e.pool.n + n)

    def _phase_end(self) -> None:
        if self._has_trained:
            self._has_trained = False
            if self._step_done():
                return
        sequences = self.e.pool.demand_s - self._seq_s0
        self._seq_s0 = self.e.pool.demand_s
        if self._gen_time > 0 and sequences > 0:
            busy = math.ceil(sequences / self._gen_time / self.w.half_batch - 1e-9)
            hold = math.ceil(self.per_step / self.w.max_seqs_per_accelerator - 1e-9)
            self._n_inf = min(max(busy, hold, 1), self.n - 1)
        self.e.note_share()
        self.e.pool.set_accelerators(0)
        self.e.after(self.w.weight_sync_s + self.w.reshard_s, self._begin_phase)

    def _begin_phase(self) -> None:
        batch, self._generated = self._generated, []
        self.e.pool.served_version = self.version
        more = self._batches < self.target
        self._begin_train(batch, self.n - self._n_inf if more else self.n)
        self.e.note_share()
        if more:
            self._batches += 1
            self._gen_running = True
            self._gen_since = self.e.now
            self.e.pool.set_accelerators(self._n_inf)
            self._to_start = self.per_step
            self.fill()

    def waiting_groups(self) -> int:
        return len(self._generated)
