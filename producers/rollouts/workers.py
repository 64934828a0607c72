"""The rollout service's stage workers: ``rollstream workers --stage init|run|eval|all``.

Each stage is a Kafka consumer group (``rollstream.rollouts.<stage>``, namespaced like the
topics) over its queue ``<ns>.rollout.tasks.<stage>``; a worker process runs the stages it is
given, ``rollouts_concurrency`` messages at once per stage, so a stage scales by adding workers
and a slow stage never holds another's messages. A stage's consumer loop is
stage_worker.StageWorker; this module holds what a message's stage does (``Service``) and
``run_workers``. For one message a worker:

- INIT: opens the rollout at the proxy, creates the sandbox (runner.RolloutStages.init_stage),
  releases its claim with the RUN message in it and sends that message;
- RUN: claims the sandbox, runs the agent, releases the claim with the EVAL message, sends it;
- EVAL: claims the sandbox, runs the evaluator, posts the rewards, destroys the sandbox and
  finishes the rollout, with its job's evaluator token (``JobKeys``): minted once per job with
  the evaluator key (``rollouts_evaluator_key``; unset: the admin key), it opens only that
  job's rollouts. The other stages call the proxy with the admin key.

A message's offset is committed only once its output is durable (the next message acknowledged
by the broker, or the rollout finished at the proxy), and only in order per partition
(stages.OffsetBook); while a worker is full it pauses its partitions and keeps polling, so the
group never drops it for a long stage. A redelivered message (a rebalance, a killed worker) is
judged from the rollout's claim (stages.judge): skipped while a live worker has it, sent on when
its stage was done, or -- when the worker that had it died, or its sandbox is gone -- the
sandbox is destroyed, the rollout finished ``aborted`` and its next attempt queued (a new
rollout id in the same group; none once the job's attempts are used). A sweep every
``rollouts_sweep_s`` does the same for claims whose holder died, and destroys unclaimed sandboxes
of dead workers (reaper.py), so a worker killed with SIGKILL loses no rollout and leaks no
sandbox. A cancelled job's messages (``rollout.jobs``) are dropped at INIT and aborted later.

A message that cannot be decoded goes to the dead-letter topic with the reason
(schemas/dlq.py); a call to the proxy that gets no answer is tried again (the offset waits).

Metrics (``rollstream_workers_*``, docs/metrics.md) on ``metrics_port`` when set: messages taken
and done per stage, in flight, seconds per stage, rollouts finished by stage and status, dead
letters; live while every stage's loop goes round, ready once the workers are up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from rollstream.adapters.metrics import ServiceMetrics, serve_metrics
from rollstream.producers.errors import RolloutCallError, RolloutExists, SandboxError
from rollstream.producers.rollouts.agents import AgentOutcome, RolloutEndpoint, build_agent
from rollstream.producers.rollouts.capacity import (
    Capacity,
    DecisionWatcher,
    Reporter,
)
from rollstream.producers.rollouts.claims import ClaimFile, ClaimStore, holder_id
from rollstream.producers.rollouts.evaluators import build_evaluator
from rollstream.producers.rollouts.local_jobs import provider_for
from rollstream.producers.rollouts.reaper import kill_marked_processes
from rollstream.producers.rollouts.runner import (
    ProxyClient,
    RolloutResult,
    RolloutStages,
    open_rollout,
)
from rollstream.producers.rollouts.sandbox import SandboxLabels, SandboxProvider
from rollstream.producers.rollouts.settings import RolloutSettings
from rollstream.producers.rollouts.stage_worker import JobWatcher, StageWorker, group_name
from rollstream.producers.rollouts.stages import (
    STAGES,
    AgentSummary,
    Endpoint,
    StageMessage,
    StageName,
    judge,
    next_stage,
    retry,
)
from rollstream.schemas.dlq import dlq_headers

__all__ = ["JobKeys", "Service", "StageWorker", "group_name", "run_workers", "stages_of"]

log = logging.getLogger("rollstream.producers.rollouts.workers")

SEND_TIMEOUT_S: Final = 60.0
STOP_SEND_S: Final = 3.0  # once stopping: the longest wait for one send's ack, and the final flush
MAX_JOB_TOKENS: Final = 1024  # jobs whose evaluator token a worker keeps (least recent go first)


def stages_of(text: str) -> list[StageName]:
    """``all`` or a comma list of stage names, in pipeline order."""
    names = (
        {"init", "run", "eval"} if text.strip() == "all" else {s.strip() for s in text.split(",")}
    )
    unknown = names - set(STAGES)
    if unknown or not names:
        raise ValueError(f"stages: {sorted(unknown) or text!r} (known: init, run, eval, all)")
    return [s for s in STAGES if s in names]


class JobKeys:
    """The EVAL stage's proxy key per job: the job's evaluator token, minted with the evaluator
    key (``ProxyClient.evaluator_token``) at the job's first call and kept for the
    ``max_jobs`` most recent jobs; a 401 with it (a proxy restarted with a new random secret)
    mints it again. A proxy without the route (404: an older one) gets the evaluator key itself
    from then on, logged once. Thread-safe: the stage's threads share it."""

    def __init__(
        self, proxy: ProxyClient, evaluator_key: str | None, max_jobs: int = MAX_JOB_TOKENS
    ) -> None:
        self.proxy, self.max_jobs = proxy, max_jobs
        self._evaluator_key = evaluator_key
        self._tokens: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.no_route = False  # the proxy answered 404: no job tokens from it
        self.minted = 0

    def client(self, job_id: str) -> ProxyClient:
        """A client of the evaluator's connections that calls with the job's key."""
        return self.proxy.keyed(lambda renew: self.key(job_id, renew=renew))

    def key(self, job_id: str, *, renew: bool = False) -> str | None:
        """The job's token (``renew``: a fresh one), or the evaluator key (module docstring).
        Raises RolloutCallError when the proxy gives none (no answer, a refusal)."""
        with self._lock:  # held while minting: a job's first calls in parallel mint once
            if self.no_route:
                return self._evaluator_key
            token = None if renew else self._tokens.get(job_id)
            if token is not None:
                self._tokens.move_to_end(job_id)
                return token
            try:
                token = self.proxy.evaluator_token(job_id)
            except RolloutCallError as exc:
                if exc.status != 404:
                    raise
                log.warning(
                    "the proxy has no evaluator-token route (an older proxy): the EVAL "
                    "stage posts rewards and finishes with the evaluator key itself"
                )
                self.no_route = True
                return self._evaluator_key
            self._tokens[job_id] = token
            self._tokens.move_to_end(job_id)
            while len(self._tokens) > self.max_jobs:
                self._tokens.popitem(last=False)
            self.minted += 1
        return token


class Service:
    """What the stage workers of one process share: the proxy client, the sandbox providers,
    the claims, the producer, the cancelled jobs and the rollouts running here."""

    def __init__(
        self,
        settings: RolloutSettings,
        stop: threading.Event,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.environ = dict(os.environ if environ is None else environ)  # command agents' env
        self.stop = stop
        self.topics = settings.topics()
        self.me = holder_id()
        self.worker_id = settings.rollouts_worker_id or f"{socket.gethostname()}-{os.getpid()}"
        admin, evaluator = settings.rollouts_admin_key, settings.rollouts_evaluator_key
        self.proxy = ProxyClient(settings.rollouts_proxy_url, admin or evaluator)
        # the EVAL stage's calls: its job's token, minted with the evaluator key (unset: admin)
        eval_key = evaluator or admin
        self.evaluator_proxy = ProxyClient(settings.rollouts_proxy_url, eval_key)
        self.job_keys = JobKeys(
            self.evaluator_proxy, eval_key.get_secret_value() if eval_key else None
        )
        self.claims = ClaimStore(settings.home / "claims")
        self.producer = Producer(
            {**settings.kafka_config(), "acks": "all", "enable.idempotence": True, "linger.ms": 5}
        )
        self.cancelled: set[str] = set()
        self.capacity = Capacity(self.worker_id, settings.rollouts_follow_controller)
        self._providers: dict[str, SandboxProvider] = {}
        self._running: set[tuple[str, str]] = set()  # (rollout id, stage) running here
        self._lock = threading.Lock()
        self.metrics = m = ServiceMetrics("workers")
        self.stage_seconds = m.histogram("stage_seconds", "one message's stage", ("stage",))
        self.rollouts_finished = m.counter(
            "rollouts_finished",
            "rollouts finished here, by the stage they ended in and their status",
            ("stage", "status"),
        )
        self.dead_letters = m.counter(
            "dead_letters", "stage messages sent to the dead letters", ("stage", "code")
        )

    def close(self) -> None:
        left = self.producer.flush(STOP_SEND_S)
        if left:  # a stage message or dead letter among them had its offset left uncommitted
            log.warning(
                "stopping: %d records not acknowledged by the broker (load reports, or sends "
                "whose messages are not committed and come back)",
                left,
            )
        self.proxy.close()
        self.evaluator_proxy.close()
        for provider in self._providers.values():
            provider.close()

    # --- shared parts ---

    def provider(self, msg: StageMessage) -> SandboxProvider:
        kind = msg.job.sandbox.kind
        with self._lock:
            if kind not in self._providers:
                self._providers[kind] = provider_for(msg.job, self.settings)
            return self._providers[kind]

    @contextlib.contextmanager
    def running(self, rollout_id: str, stage: str = "") -> Iterator[bool]:
        """True when this process was not running ``stage`` of ``rollout_id`` already (then it
        is, inside). A stage sends the next stage's message while still inside, so that message
        is no duplicate; ``stage`` empty (the sweep): when no stage of the rollout runs here
        (the sweep only reads a claim then; a stage message is never held up by it)."""
        key = (rollout_id, stage)
        with self._lock:
            here = {s for rid, s in self._running if rid == rollout_id}
            fresh = stage not in here if stage else not here  # the sweep never blocks a stage
            if fresh:
                self._running.add(key)
        try:
            yield fresh
        finally:
            if fresh:
                with self._lock:
                    self._running.discard(key)

    def send(self, msg: StageMessage) -> None:
        """Queue ``msg`` on its stage's topic and wait for the broker's acknowledgement."""
        self._produce(self.topics.task(msg.stage), msg.rollout_id, msg.encode())

    def _produce(self, topic: str, key: str, value: bytes, headers: Any = None) -> None:
        done = threading.Event()
        failure: list[KafkaError] = []

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                failure.append(err)
            done.set()

        self.producer.produce(topic, key=key, value=value, headers=headers, on_delivery=delivered)
        deadline = time.monotonic() + SEND_TIMEOUT_S
        stopping = False
        while not done.is_set():
            self.producer.poll(0.05)
            if self.stop.is_set() and not stopping:  # the message is not finished: it comes back
                stopping, deadline = True, min(deadline, time.monotonic() + STOP_SEND_S)
            if time.monotonic() > deadline:
                raise KafkaException(KafkaError(KafkaError._MSG_TIMED_OUT))
        if failure:
            raise KafkaException(failure[0])

    def dead_letter(self, raw: Message, reason: str, stage: str, code: str) -> None:
        self.dead_letters.labels(stage, code).inc()
        headers = dlq_headers(
            reason=reason[:1000],
            code=code,
            topic=raw.topic() or "",
            partition=raw.partition() or 0,
            offset=raw.offset() or 0,
            stage=f"rollouts-{stage}",
            processor=self.worker_id,
        )
        self._produce(
            self.topics.dlq,
            (raw.key() or b"").decode(errors="replace"),
            raw.value() or b"",
            headers,
        )

    # --- one message ---

    def handle(self, msg: StageMessage) -> None:
        """Do ``msg``'s stage (module docstring). Raises only RolloutCallError without an
        answer (try again later) and what the broker refuses."""
        with self.running(msg.rollout_id, msg.stage) as fresh:
            if not fresh:
                return  # this process runs it: a duplicate after a rebalance
            if msg.job.id in self.cancelled:
                self._cancel(msg)
            elif msg.stage == "init":
                self._init(msg)
            else:
                self._later(msg)

    def _stages(self, msg: StageMessage, endpoint: RolloutEndpoint | None = None) -> RolloutStages:
        """The rollout's stages, its agent and evaluator built once; INIT opens the rollout
        (``open``) before it has an endpoint, the later stages have it from the message."""
        job = msg.job
        agent = build_agent(job.agent, environ=self.environ)
        evaluator = build_evaluator(job.evaluator)
        if endpoint is None:
            endpoint = open_rollout(self.proxy, msg.plan, job, agent, evaluator)
        proxy = self.job_keys.client(msg.job.id) if msg.stage == "eval" else self.proxy
        return RolloutStages(
            msg.plan, job, msg.task, endpoint, self.provider(msg), agent, evaluator,
            self.worker_id, log, proxy,
        )  # fmt: skip

    def _init(self, msg: StageMessage) -> None:
        try:
            stages = self._stages(msg)
        except RolloutExists:
            self._redelivered(msg)
            return
        try:
            failed = stages.init_stage()
            if failed is not None:
                stages.destroy()
                self._conclude(stages, failed, msg)
                return
            assert stages.sandbox is not None
            ep = stages.endpoint
            following = next_stage(
                msg,
                now=time.time(),
                sandbox_id=stages.sandbox.id,
                endpoint=Endpoint(
                    base_url=ep.base_url,
                    token=ep.token,
                    api_url=ep.api_url,
                    policy_version=ep.policy_version,
                ),
                durations=stages.durations,
            )
            self._hand_on(msg, stages.sandbox.id, following)
        except KafkaException:  # the hand-on's send: the claim holds the next message (resend)
            raise
        except BaseException as exc:
            stages.fail(exc)
            self.claims.remove(msg.rollout_id)
            raise

    def _later(self, msg: StageMessage) -> None:
        """RUN or EVAL: take the sandbox from its claim, or settle what the claim says."""
        assert msg.sandbox_id is not None and msg.endpoint is not None
        with self.claims.locked(msg.rollout_id):
            found = self.claims.read(msg.rollout_id)
            verdict = judge(found.claim() if found else None, msg.stage, me=self.me)
            if verdict == "take":
                self.claims.write(
                    ClaimFile(
                        msg.rollout_id, msg.sandbox_id, msg.job.sandbox.kind, msg.stage,
                        self.me, False, msg.encode(),
                    )
                )  # fmt: skip
        if verdict != "take":
            self._settle(msg, verdict, found)
            return
        spec = msg.job.sandbox.to_spec(SandboxLabels(job_id=msg.job.id, rollout_id=msg.rollout_id))
        try:
            sandbox = self.provider(msg).attach(msg.sandbox_id, spec)
        except SandboxError as exc:
            log.warning("rollout %s: %s", msg.rollout_id, exc)
            self._settle(msg, "gone", found)
            return
        e = msg.endpoint
        endpoint = RolloutEndpoint(msg.rollout_id, e.base_url, e.token, e.api_url, e.policy_version)
        stages = self._stages(msg, endpoint)
        stages.sandbox, stages.sandbox_id = sandbox, sandbox.id
        stages.durations.update(msg.durations)
        try:
            if msg.stage == "run":
                outcome = stages.run_stage()
                if isinstance(outcome, RolloutResult):
                    stages.destroy()
                    self._conclude(stages, outcome, msg)
                    return
                summary = AgentSummary(
                    status=outcome.status,
                    stop=outcome.stop[:200],
                    reason=outcome.reason[:2000],
                    turns=outcome.turns,
                )
                following = next_stage(
                    msg, now=time.time(), agent=summary, durations=stages.durations
                )
                self._hand_on(msg, sandbox.id, following)
            else:
                a = msg.agent
                assert a is not None
                result = stages.eval_stage(AgentOutcome(a.status, a.stop, a.reason, a.turns))
                stages.destroy()
                self._conclude(stages, result, msg)
        except KafkaException:  # the hand-on's send: the claim holds the next message (resend)
            raise
        except BaseException as exc:
            stages.fail(exc)
            self.claims.remove(msg.rollout_id)
            raise

    def _hand_on(self, msg: StageMessage, sandbox_id: str, following: StageMessage) -> None:
        """Release the claim with the next message in it, then send that message."""
        with self.claims.locked(msg.rollout_id):
            self.claims.write(
                ClaimFile(
                    msg.rollout_id, sandbox_id, msg.job.sandbox.kind, msg.stage, "", True,
                    following.encode(),
                )
            )  # fmt: skip
        self.send(following)

    def _conclude(self, stages: RolloutStages, result: RolloutResult, msg: StageMessage) -> None:
        """Rewards and finish; a sandbox that could not start is tried again (a new attempt)."""
        stages.conclude(result)
        self.rollouts_finished.labels(result.stage, result.status).inc()
        self.claims.remove(msg.rollout_id)
        if result.stage == "init" and result.status == "failed":
            self._retry(msg)

    def _settle(self, msg: StageMessage, verdict: str, found: ClaimFile | None) -> None:
        if verdict in ("busy", "skip"):
            log.info("rollout %s: %s message skipped (%s)", msg.rollout_id, msg.stage, verdict)
        elif verdict == "resend" and found is not None:
            self.send(StageMessage.decode(found.message))
        else:  # dead, gone (and an init leftover of this process)
            where = found.stage if found else msg.stage
            why = "the worker holding it stopped" if verdict == "dead" else "its sandbox is gone"
            self.abandon(msg, found, f"{where}: {why}")

    def _redelivered(self, msg: StageMessage) -> None:
        """An INIT message whose rollout is open already."""
        with self.claims.locked(msg.rollout_id):
            found = self.claims.read(msg.rollout_id)
        verdict = judge(found.claim() if found else None, "init", me=self.me)
        self._settle(msg, "dead" if verdict == "take" else verdict, found)

    def abandon(self, msg: StageMessage, found: ClaimFile | None, reason: str) -> None:
        """Destroy the rollout's sandbox, finish it ``aborted`` and queue its next attempt
        (when this call finished it: a rollout that ended before is left as it ended)."""
        sandbox_id = found.sandbox_id if found else msg.sandbox_id
        if sandbox_id:
            self.destroy(msg, sandbox_id)
        try:
            finished = self.proxy.finish(msg.rollout_id, "aborted", reason)
        except RolloutCallError as exc:
            if exc.status is None:
                raise  # no answer: the message is tried again
            # 404: the proxy does not know it (restarted): this attempt is lost, the next runs
            finished = exc.status == 404
            log.warning("rollout %s: not aborted: %s", msg.rollout_id, exc)
        self.claims.remove(msg.rollout_id)
        if finished:
            self.rollouts_finished.labels(msg.stage, "aborted").inc()
            log.warning("rollout %s aborted (%s)", msg.rollout_id, reason)
            self._retry(msg)

    def lost(self, msg: StageMessage, exc: RolloutCallError) -> None:
        """The proxy does not know the rollout (404: it restarted and forgot its open
        rollouts): this attempt cannot finish there. Its sandbox goes, its claim too, and the
        next attempt is queued; the rollout's events end on the log without a finish (the
        processors close it at their inactivity timeout, ``truncated``)."""
        with self.claims.locked(msg.rollout_id):
            found = self.claims.read(msg.rollout_id)
        sandbox_id = found.sandbox_id if found else msg.sandbox_id
        if sandbox_id:
            self.destroy(msg, sandbox_id)
        self.claims.remove(msg.rollout_id)
        self.rollouts_finished.labels(msg.stage, "lost").inc()
        log.warning("rollout %s lost by the proxy at %s (%s): retried", msg.rollout_id,
                    msg.stage, exc)  # fmt: skip
        self._retry(msg)

    def destroy(self, msg: StageMessage, sandbox_id: str) -> None:
        provider = self.provider(msg)
        if provider.kind in ("bwrap", "local"):
            kill_marked_processes(sandbox_id)
        try:
            provider.remove(sandbox_id)
        except (SandboxError, OSError):  # the reaper takes what is left
            log.warning("sandbox %s could not be removed", sandbox_id, exc_info=True)

    def _retry(self, msg: StageMessage) -> None:
        following = retry(msg, now=time.time())
        if following is None:
            log.warning("rollout %s: the job's attempts are used up", msg.rollout_id)
            return
        log.info("rollout %s: retried as %s", msg.rollout_id, following.rollout_id)
        self.send(following)

    def _cancel(self, msg: StageMessage) -> None:
        if msg.stage == "init":
            log.info("rollout %s: job %s is cancelled: not started", msg.rollout_id, msg.job.id)
            return
        with self.claims.locked(msg.rollout_id):
            found = self.claims.read(msg.rollout_id)
        verdict = judge(found.claim() if found else None, msg.stage, me=self.me)
        if verdict in ("busy", "skip"):
            return
        if msg.sandbox_id:
            self.destroy(msg, msg.sandbox_id)
        with contextlib.suppress(RolloutCallError):
            self.proxy.finish(msg.rollout_id, "aborted", f"{msg.stage}: the job was cancelled")
        self.claims.remove(msg.rollout_id)

    # --- the sweep ---

    def sweep(self) -> list[str]:
        """Settle claims whose holder died; destroy unclaimed sandboxes of dead workers.
        Returns the rollout ids abandoned."""
        abandoned = []
        for rid in self.claims.rollout_ids():
            with self.running(rid) as fresh:
                if not fresh:
                    continue
                with self.claims.locked(rid):
                    found = self.claims.read(rid)
                if found is None or found.released or not found.holder:
                    continue
                claim = found.claim()
                if claim.alive or found.holder == self.me:
                    continue
                try:
                    msg = StageMessage.decode(found.message)
                except ValueError:
                    self.claims.remove(rid)
                    continue
                try:
                    self.abandon(msg, found, f"{found.stage}: the worker holding it stopped")
                except (SandboxError, OSError) as exc:  # the next sweep tries again
                    log.warning("sweep: rollout %s: %s", rid, exc)
                    continue
                abandoned.append(rid)
        claimed = self.claims.sandbox_ids()
        with self._lock:
            providers = list(self._providers.values())
        for provider in providers:
            for record in provider.records():
                if record.id not in claimed and record.reap_reason() is not None:
                    if provider.kind in ("bwrap", "local"):
                        kill_marked_processes(record.id)
                    with contextlib.suppress(SandboxError, OSError):  # another reaper's race
                        provider.remove(record.id)
        return abandoned


def _sweep(service: Service) -> None:
    """One sweep; what fails in it (the proxy away, another worker removing the same sandbox)
    is logged and left to the next one, never the end of the worker."""
    try:
        service.sweep()
    except (RolloutCallError, KafkaException, SandboxError, OSError) as exc:
        log.warning("sweep: %s", exc)


def _export(metrics: ServiceMetrics, workers: list[StageWorker]) -> None:
    """The stage workers' own counters, read at scrape time; ready while every one runs."""

    def each(read: Callable[[StageWorker], float]) -> Callable[[], dict[tuple[str, ...], float]]:
        return lambda: {(w.stage,): read(w) for w in workers}

    m, stage = metrics, ("stage",)
    m.counter_fn("messages_started", "stage messages taken", each(lambda w: w.meter.started), stage)
    m.counter_fn(
        "messages_done", "stage messages whose work ended", each(lambda w: w.meter.done), stage
    )
    m.counter_fn("busy_seconds", "seconds of stage work", each(lambda w: w.meter.busy_s), stage)
    m.gauge_fn(
        "in_flight",
        "stage messages held (taken, not committed)",
        each(lambda w: w.book.count()),
        stage,
    )
    m.gauge_fn("limit", "stage messages this worker may hold now", each(lambda w: w.limit()), stage)

    def running() -> tuple[bool, str]:
        down = [w.stage for w in workers if not w.is_alive() or w.error is not None]
        return not down, f"stopped: {','.join(down)}" if down else "running"

    m.health.watch("workers", running)


def run_workers(
    settings: RolloutSettings,
    *,
    stop: threading.Event | None = None,
    on_ready: Callable[[], None] | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Run the stage workers ``settings.rollouts_stages`` names until SIGTERM / SIGINT (or
    ``stop``); 0 on a clean stop, 1 when a worker failed."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    service = Service(settings, stop, environ)
    stages = stages_of(settings.rollouts_stages)
    service.metrics.health.set("workers", False, "starting")
    metrics_server = serve_metrics(settings, service.metrics)
    try:
        _sweep(service)
        watcher = JobWatcher(service)
        watcher.start()
        workers = [StageWorker(service, s, settings.rollouts_concurrency) for s in stages]
        if "run" in stages and settings.rollouts_follow_controller:
            run_worker = next(w for w in workers if w.stage == "run")
            decisions = DecisionWatcher(settings, service.capacity, stop, run_worker.wake.set)
            decisions.prime()
            decisions.start()
        for w in workers:
            w.start()
        _export(service.metrics, workers)
        reporter = Reporter(
            settings,
            service.worker_id,
            service.producer,
            lambda: {w.stage: w.load() for w in workers},
            stop,
        )
        reporter.start()
        log.info(
            "workers for %s up (%d at once each)", ",".join(stages), settings.rollouts_concurrency
        )
        if on_ready is not None:
            on_ready()
        while not stop.wait(settings.rollouts_sweep_s):
            _sweep(service)
        for w in workers:
            w.join(timeout=30)
        reporter.join(timeout=5)
        return 1 if any(w.error for w in workers) else 0
    finally:
        stop.set()
        service.close()
        if metrics_server is not None:
            metrics_server.stop()
