"""rollstream in the simulator: fully async (sim_policies.FullyAsync's trainer and weight
updates) driven by ``policy.decide``, the function the live controller runs.

    rollstream          every ``control_period_s`` and at each new version the driver builds
                        the ``Signals`` the live controller would see and applies the
                        ``Decision`` as the live RUN workers do: ``admit`` is a start budget
                        until the next decision (rollouts start while it lasts and a RUN slot
                        is free; a new decision replaces it, unused starts are not carried
                        over), and the split
                        (accelerators that move idle ``reshard_s``: toward training at once,
                        toward inference when the trainer's chunk ends) within [1/N, 1 -
                        1/N]: at least one accelerator on each side, as the other separate-pool
                        policies. Weight updates as the proxy does them by default
                        (``proxy_weight_update_mode=drain``): hold new requests, drain the
                        decoding ones, load, resume.
    rollstream_partial  the same policy with the proxy's interrupt mode
                        (``proxy_weight_update_mode=interrupt``): an update cuts the decoding
                        sequences, which go on with the new weights after a re-prefill
                        (partial rollouts).

Pure: no I/O.
"""

from __future__ import annotations

from typing import Final

from rollstream.consumers.control.policy import Decision, PolicyConfig, Signals, decide
from rollstream.consumers.control.sim_policies import FullyAsync

__all__ = ["Rollstream", "RollstreamPartial"]

QUEUED: Final = 10**9  # tasks waiting to be rolled out: the supply never runs dry here


class Rollstream(FullyAsync):
    interrupt = False

    def start(self) -> None:
        n = self.n
        self.config = PolicyConfig(
            max_staleness=self.w.max_staleness,
            min_share=1 / n,
            max_share=1 - 1 / n,
            share_step=max(0.1, 1 / n),
            cooldown_s=self.w.control_cooldown_s,
        )
        self.decision: Decision | None = None
        self.decisions: list[Decision] = []
        self._grant = 0  # starts the newest decision still allows
        self._idle_seen = 0.0
        self._to_inference = 0.0  # accelerators leaving training at the next chunk boundary
        self._transit = 0.0  # accelerators on their way to inference (resharding)
        super().start()
        self._decide()
        self.e.after(self.w.control_period_s, self._tick)

    def _tick(self) -> None:
        if self.e.stopped:
            return
        self._decide()
        self.e.after(self.w.control_period_s, self._tick)

    def signals(self) -> Signals:
        e, w = self.e, self.w
        per_group = w.group_size * w.samples_per_rollout
        idle = self.idle_now()
        signals = Signals(
            t=e.now,
            trained_version=self.version,
            max_staleness=w.max_staleness,
            samples_waiting=len(self._buffer) * per_group,
            samples_per_step=float(w.samples_per_step),
            samples_per_rollout=float(w.samples_per_rollout),
            rollouts_in_flight=e.in_flight,
            rollouts_queued=QUEUED,
            run_slots_max=self.slots_max(),
            inference_share=e.pool.n / self.n,
            backend_utilisation=e.pool.utilisation(),
            step_time_s=self.step_time,
            rollout_time_s=e.mean_rollout_time(),
            trainer_idle_s=max(0.0, idle - self._idle_seen),
            samples_consumed_in_step=self._taken * per_group,
            serving_version=min(e.pool.served_version, self.version),
            rollouts_running=e.running,
        )
        self._idle_seen = idle
        return signals

    def _decide(self) -> None:
        decision = decide(self.signals(), self.config, self.decision)
        self.decision = decision
        self.decisions.append(decision)
        self._grant = decision.admit
        self._move_to(decision.inference_share)
        self.fill()

    def fill(self) -> None:
        if self.decision is None:
            return
        e, slots = self.e, self.slots_max()
        while self._grant > 0 and e.running < slots:
            e.start_rollout(e.pool.served_version)
            self._grant -= 1

    def _move_to(self, share: float) -> None:
        e = self.e
        current = e.pool.n + self._to_inference + self._transit
        target = min(max(round(share * self.n), 1), self.n - 1)
        if target < current:  # toward training: at once; the trainer has them after reshard_s
            give = current - target
            take_back = min(give, self._to_inference)
            self._to_inference -= take_back
            move = give - take_back
            if move > 0:
                e.note_share()
                e.pool.set_accelerators(e.pool.n - move)
                e.after(self.w.reshard_s, self._join_training, move)
        elif target > current:  # toward inference: when the trainer's chunk ends
            self._to_inference += target - current
            if not self._busy:
                self.chunk_boundary()

    def _join_training(self, n: float) -> None:
        self.n_train += n

    def _join_inference(self, n: float) -> None:
        self._transit -= n
        self.e.note_share()
        self.e.pool.set_accelerators(self.e.pool.n + n)
        self.fill()

    def chunk_boundary(self) -> None:
        move = min(self._to_inference, self.n_train - 1)
        self._to_inference = 0.0
        if move > 0:
            self.n_train -= move
            self._transit += move
            self.e.after(self.w.reshard_s, self._join_inference, move)

    def new_version(self) -> None:
        self._decide()


class RollstreamPartial(Rollstream):
    interrupt = True
