"""The model loop of the reference inference server: one worker thread owns the model, and a
scheduler runs queued requests through it in batches.

Requests queue up; the scheduler takes up to ``model_max_batch`` of them (after waiting
``model_batch_wait_ms`` for company) and runs them as one batch in that thread, so the event
loop (and /health) stays free. Weight loads run in the same thread between batches, so every
completion comes from exactly one policy version, which ``Scheduler.submit`` returns with it.
No HTTP here: server.py parses requests and calls ``submit``, ``stream``, ``pause``,
``resume``, ``call``.

Streaming (``Scheduler.stream``): the request rides in a batch like any other; after every
decoding step the worker thread hands the batch's new tokens to the event loop in one
``loop.call_soon_threadsafe`` call, which puts each streamed request's ``TokenStep`` on that
request's own queue, so the waiting HTTP response sends it at once. A streamed request whose
consumer goes away (the client hung up) is marked aborted: the worker ends its row at the next
step (finish_reason "abort") and the rest of the batch goes on; one still queued is skipped.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from rollstream.inference.errors import RequestRefused
from rollstream.inference.settings import ModelServerSettings
from rollstream.inference.tinymodel import (
    GenerationResult,
    SamplingParams,
    apply_state_dict,
    ensure_tiny_model,
    generate,
    load_model,
    load_state_dict,
    stop_token_ids,
)

__all__ = ["Engine", "Scheduler", "TokenStep"]

T = TypeVar("T")


class Engine:
    """The model, its tokenizer and the policy version. Used only from the worker thread,
    except for read-only attributes (tokenizer, vocab, version)."""

    def __init__(self, settings: ModelServerSettings) -> None:
        self.settings = settings
        self.path = settings.resolved_model_path()
        self.version = 0
        self.weights_path = str(self.path)
        self.loaded_at = 0.0

    def load(self) -> None:
        s = self.settings
        if s.model_torch_threads:
            torch.set_num_threads(s.model_torch_threads)
        if s.model_create:
            ensure_tiny_model(self.path, seed=s.model_seed)
        self.model, self.tokenizer = load_model(self.path, device=s.model_device)
        self.vocab = int(self.model.config.vocab_size)
        self.max_len = s.model_max_len or int(self.model.config.max_position_embeddings)
        self.eos = stop_token_ids(self.tokenizer)
        self.loaded_at = time.time()

    def run(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        abort: Callable[[], bool],
        row_abort: Callable[[int], bool] | None = None,
        on_step: Callable[[int, list[tuple[int, GenerationResult, bool]]], None] | None = None,
    ) -> tuple[list[GenerationResult], int]:
        """One batch; ``on_step(version, rows)`` after each decoding step (see ``generate``)."""
        version = self.version  # /update_weight_version may change it during the batch
        step = None if on_step is None else (lambda rows: on_step(version, rows))
        results = generate(
            self.model,
            prompts,
            params,
            eos_token_ids=self.eos,
            pad_token_id=self.tokenizer.pad_token_id or 0,
            logprobs_mode=self.settings.model_logprobs_mode,
            should_abort=abort,
            row_abort=row_abort,
            on_step=step,
        )
        return results, version

    def load_weights(self, path: str, version: int | None) -> int:
        apply_state_dict(self.model, load_state_dict(path))
        self.weights_path, self.loaded_at = path, time.time()
        if version is not None:
            self.version = version
        return self.version


@dataclass(frozen=True, slots=True)
class TokenStep:
    """One token of a streamed request, as soon as it is sampled. ``finish_reason`` (stop,
    length, abort) and ``stop_reason`` are set on the request's last token only."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None
    stop_reason: int | None
    policy_version: int


@dataclass(slots=True)
class _Pending:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future[tuple[GenerationResult, int]]
    steps: asyncio.Queue[TokenStep | None] | None = None  # streamed: its tokens, then None
    aborted: bool = False  # streamed: the consumer went away


def _step(r: GenerationResult, done: bool, version: int) -> TokenStep:
    return TokenStep(
        r.token_ids[-1],
        r.logprobs[-1],
        r.top_logprobs[-1] if r.top_logprobs else None,
        r.finish_reason if done else None,
        r.stop_reason if done else None,
        version,
    )


def _deliver(items: list[tuple[asyncio.Queue[TokenStep | None], TokenStep]]) -> None:
    for queue, step in items:
        queue.put_nowait(step)


class Scheduler:
    """Queues requests and runs them in batches in the single worker thread."""

    def __init__(self, engine: Engine, settings: ModelServerSettings) -> None:
        self.engine = engine
        self.max_batch = max(1, settings.model_max_batch)
        self.wait_s = max(0.0, settings.model_batch_wait_ms / 1000)
        self.max_queue = settings.model_max_queue
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.queue: deque[_Pending] = deque()
        self.wake = asyncio.Event()
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.abort = threading.Event()
        self.running: asyncio.Future[Any] | None = None
        self.task: asyncio.Task[None] | None = None
        self.arriving = 0  # requests received but not yet queued (body being read or parsed)
        self.in_batch = 0  # requests in the batch being generated
        self.streams_aborted = 0  # streamed requests whose consumer went away before the end

    @property
    def paused(self) -> bool:
        return not self.unpaused.is_set()

    def start(self) -> None:
        """Start the batching loop (on the running event loop)."""
        self.task = asyncio.create_task(self.loop(), name="model-scheduler")

    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` in the worker thread, after the batch in progress (never during it)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def submit(
        self, prompt: list[int], params: SamplingParams
    ) -> tuple[GenerationResult, int]:
        """Generate one completion; returns it with the policy version that produced it."""
        if len(self.queue) >= self.max_queue:
            raise RequestRefused("server queue is full", status=503)
        pending = _Pending(prompt, params, asyncio.get_running_loop().create_future())
        self.queue.append(pending)
        self.wake.set()
        return await pending.future

    def stream(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenStep]:
        """Queue one streamed completion now (RequestRefused 503 when the queue is full) and
        return its tokens as they are sampled; the last one carries the finish reason. Closing
        the iterator before the end aborts the request (its row stops at the next step)."""
        if len(self.queue) >= self.max_queue:
            raise RequestRefused("server queue is full", status=503)
        loop = asyncio.get_running_loop()
        pending = _Pending(prompt, params, loop.create_future(), steps=asyncio.Queue())
        self.queue.append(pending)
        self.wake.set()
        return self._steps(pending)

    async def _steps(self, pending: _Pending) -> AsyncIterator[TokenStep]:
        assert pending.steps is not None
        finished = False
        try:
            while (step := await pending.steps.get()) is not None:
                yield step
            await pending.future  # the batch's error, if it failed
            finished = True
        finally:
            if not finished:
                pending.aborted = True
                self.streams_aborted += 1
                if not pending.future.done():
                    pending.future.cancel()

    async def pause(self, mode: str) -> None:
        """Stop taking new batches; ``abort`` also ends the batch in progress early."""
        self.unpaused.clear()
        if mode == "abort":
            self.abort.set()
        try:
            if self.running is not None:
                await asyncio.shield(self.running)
        except Exception:  # the batch's own requests get the error
            pass
        finally:
            self.abort.clear()

    def resume(self) -> None:
        self.unpaused.set()
        self.wake.set()

    async def loop(self) -> None:
        while True:
            await self.wake.wait()
            await self.unpaused.wait()
            if self.wait_s and len(self.queue) < self.max_batch:  # wait a little for company
                await asyncio.sleep(self.wait_s)
                deadline = time.monotonic() + 10 * self.wait_s
                while self.arriving and len(self.queue) < self.max_batch:
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(self.wait_s / 4)
            if self.paused:
                continue
            batch: list[_Pending] = []
            while self.queue and len(batch) < self.max_batch:
                p = self.queue.popleft()
                if not p.future.done() and not p.aborted:  # a cancelled request is skipped
                    batch.append(p)
            if not self.queue:
                self.wake.clear()
            if batch:
                await self._run(batch)

    async def _run(self, batch: list[_Pending]) -> None:
        prompts, params = [p.prompt for p in batch], [p.params for p in batch]
        self.in_batch = len(batch)
        loop = asyncio.get_running_loop()
        queues = [p.steps for p in batch]
        on_step = None
        if any(q is not None for q in queues):

            def on_step(version: int, rows: list[tuple[int, GenerationResult, bool]]) -> None:
                items = [
                    (q, _step(r, done, version))
                    for i, r, done in rows
                    if (q := queues[i]) is not None
                ]
                if items:
                    loop.call_soon_threadsafe(_deliver, items)

        def row_abort(i: int) -> bool:
            return batch[i].aborted

        self.running = loop.run_in_executor(
            self.executor, self.engine.run, prompts, params, self.abort.is_set, row_abort, on_step
        )
        try:
            results, version = await self.running
        except Exception as exc:
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
        else:
            for p, r in zip(batch, results, strict=True):
                if not p.future.done():
                    p.future.set_result((r, version))
        finally:
            self.running, self.in_batch = None, 0
            for q in queues:  # after every token: the worker's deliveries were queued first
                if q is not None:
                    q.put_nowait(None)

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        while self.queue:
            p = self.queue.popleft()
            if not p.future.done():
                p.future.set_exception(RequestRefused("server is shutting down", status=503))
            if p.steps is not None:
                p.steps.put_nowait(None)
        self.executor.shutdown(wait=True, cancel_futures=True)
