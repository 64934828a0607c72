"""Every error rollstream.producers raises, under one root (no imports but the standard library,
so the SDK's import path stays light). The modules that raise them re-export their own.

    ProducerError                    root of rollstream.producers
    ├── ContextError                 (sdk/context.py) a call id reused, or an unknown call asked
    │                                for (ValueError)
    ├── RecorderError                (sdk/recorder.py) root of the Recorder's errors
    │   └── RecorderUsageError       a call that cannot make a valid event (ValueError)
    ├── SpoolError                   (sdk/spool.py) the spool cannot be created, locked, written
    │   │                            or read
    │   └── SpoolFull                it holds spool_max_bytes not yet delivered
    ├── TaskSuiteError               (rollouts/tasks.py) a task or suite that cannot be loaded;
    │                                .source, .field (ValueError)
    ├── SandboxError                 (rollouts/sandbox.py) root of the sandboxes' errors
    │   ├── SandboxSpecError         a spec value out of bounds; .field (ValueError)
    │   ├── SandboxUnavailable       this kind cannot run here (tool or daemon missing)
    │   ├── SandboxStateError        the sandbox was destroyed, or what backs it is gone
    │   ├── SandboxFileError         copy in/out outside the workdir, missing or too large
    │   └── SandboxExecError         a command could not be started (an exit code or a
    │                                timeout is a result, not an error)
    ├── JobSpecError                 (rollouts/jobs.py) a job spec that cannot be used: bad YAML
    │                                or JSON, a field out of bounds, an unknown agent, sandbox or
    │                                evaluator kind; .field is its path ("agent.max_turns"),
    │                                .source the file (ValueError)
    ├── AgentError                   (rollouts/agents.py) an agent that cannot be built (bad
    │                                options; ValueError); what happens in a run is an
    │                                AgentOutcome, not an error
    ├── EvaluatorError               (rollouts/evaluators.py) an evaluator that cannot be built
    │                                ("module:function" not importable, not callable;
    │                                ValueError); a check that crashes or times out is an
    │                                Evaluation, not an error
    ├── RolloutCallError             (rollouts/agents.py RolloutClient, rollouts/runner.py
    │   │                            ProxyClient) a call to the proxy's rollout API got no
    │   │                            answer or a refusal; .status (None: no answer)
    │   └── RolloutExists            the rollout id is taken at the proxy (409): a redelivered
    │                                stage message, not a second rollout
    ├── JobQueueError                (rollouts/jobqueue.py) the job queue's topics cannot be
    │   │                            read or written: the broker unreachable, a record not
    │   │                            acknowledged, a read past its timeout
    │   ├── JobExists                a job with this id was submitted already; .job_id
    │   └── JobNotFound              no job with this id was submitted; .job_id
    └── ProxyError                   root of the recording proxy's errors (producers/proxy)
        ├── ProxyConfigError         a setting or argument the proxy cannot work with (ValueError)
        ├── ApiError                 (openai_wire.py) an HTTP error answer: status, OpenAI error
        │                            type and code, param, headers
        ├── ChatError                (chat_template.py, chat.py) root of the chat rendering errors
        │   ├── ChatTemplateError    the model directory has no usable tokenizer / chat template
        │   └── ChatInputError       messages, tools or a prompt that cannot be rendered
        │                            (ValueError); .param, .code
        ├── PoolError                (pool.py) root of the backend pool's errors
        │   ├── PoolPaused           the pool stayed paused longer than the caller may wait
        │   └── NoBackendAvailable   no healthy backend within backend_wait_s (.last_error)
        └── BackendError             (backends.py) a backend call failed; .backend, .status
            ├── BackendUnavailable   connection error, timeout, 5xx or a malformed HTTP answer:
            │   │                    the pool fails over to another backend
            │   └── Http1Error       (http1.py) the HTTP/1.1 hop failed; .kind names the httpx
            │                        error it stands for (ConnectError, ReadTimeout,
            │                        RemoteProtocolError, ...)
            ├── BackendRejected      4xx: this request is wrong; retrying it will not help
            └── BackendProtocolError a 2xx answer without the fields we need

Private control flow that never leaves its module is not part of the tree: http1.py's
``_Stale`` (a reused keep-alive connection the server had closed; the request is resent on a
fresh connection inside ``Http1Transport.exchange``) and rollouts/agents.py's ``_ToolFailure``
(a tool call the model got wrong; answered to the model as a tool error inside the tool
agent's loop).
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "AgentError",
    "ApiError",
    "BackendError",
    "BackendProtocolError",
    "BackendRejected",
    "BackendUnavailable",
    "ChatError",
    "ChatInputError",
    "ChatTemplateError",
    "ContextError",
    "EvaluatorError",
    "Http1Error",
    "Http1ErrorKind",
    "JobExists",
    "JobNotFound",
    "JobQueueError",
    "JobSpecError",
    "NoBackendAvailable",
    "PoolError",
    "PoolPaused",
    "ProducerError",
    "ProxyConfigError",
    "ProxyError",
    "RecorderError",
    "RecorderUsageError",
    "RolloutCallError",
    "RolloutExists",
    "SandboxError",
    "SandboxExecError",
    "SandboxFileError",
    "SandboxSpecError",
    "SandboxStateError",
    "SandboxUnavailable",
    "SpoolError",
    "SpoolFull",
    "TaskSuiteError",
]


class ProducerError(Exception):
    """Root of every error raised by rollstream.producers."""


# --------------------------------------------------------------------------- the SDK


class ContextError(ProducerError, ValueError):
    """A call id was recorded twice, or a call id the trie does not know was asked for."""


class RecorderError(ProducerError):
    """Root of the SDK's errors."""


class RecorderUsageError(RecorderError, ValueError):
    """The harness asked for something that cannot become a valid event."""


class SpoolError(ProducerError):
    """The spool directory cannot be created, locked, written or read."""


class SpoolFull(SpoolError):
    """The spool holds its ``spool_max_bytes`` of records not yet delivered."""


# --------------------------------------------------------------------------- the proxy


class ProxyError(ProducerError):
    """Root of the recording proxy's errors."""


class ProxyConfigError(ProxyError, ValueError):
    """A setting or argument the proxy cannot work with."""


class ApiError(ProxyError):
    """An error answered to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}


class ChatError(ProxyError):
    """Root of the chat rendering errors."""


class ChatTemplateError(ChatError):
    """No usable tokenizer or chat template in the model directory."""


class ChatInputError(ChatError, ValueError):
    """Messages, tools or a prompt the template cannot render; ``param`` names the offending
    field and ``code`` is the OpenAI error code to answer with (None: none)."""

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class BackendError(ProxyError):
    """Root of the errors of a backend call (rollstream.producers.proxy.backends)."""

    def __init__(self, message: str, *, backend: str = "", status: int | None = None) -> None:
        super().__init__(f"[{backend}] {message}" if backend else message)
        self.backend, self.status = backend, status


class BackendUnavailable(BackendError):
    """The backend could not be reached, timed out, failed (5xx) or answered with a malformed
    HTTP message: the pool tries another backend."""


Http1ErrorKind = Literal[
    "ConnectError",
    "ConnectTimeout",
    "PoolTimeout",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "WriteError",
    "WriteTimeout",
]


class Http1Error(BackendUnavailable):
    """The lean HTTP/1.1 client (http1.py) failed: connect, read, write or pool (error or
    timeout), or the server's answer is not valid HTTP/1.1 (``RemoteProtocolError``). ``kind``
    is the name of the httpx exception it stands for when the client runs under httpx."""

    def __init__(self, kind: Http1ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: Http1ErrorKind = kind


class BackendRejected(BackendError):
    """The backend refused the request (4xx); ``status`` and the server's message say why."""


class BackendProtocolError(BackendError):
    """The backend answered 2xx with a body we cannot use (no token ids, lengths differ...)."""


class PoolError(ProxyError):
    """Root of the backend pool's errors."""


class PoolPaused(PoolError):
    """The pool is paused (weight update) and stayed so longer than the caller may wait."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"paused for a weight update; retry after {retry_after_s:g} s")
        self.retry_after_s = retry_after_s


class NoBackendAvailable(PoolError):
    """No healthy backend answered within the wait; ``last_error`` is the last failure seen."""

    def __init__(self, message: str, last_error: BackendError | None = None) -> None:
        super().__init__(message)
        self.last_error = last_error


class TaskSuiteError(ProducerError, ValueError):
    """A task or a suite that cannot be loaded; ``source`` names the file (and line) and
    ``field`` the offending field, where known."""

    def __init__(self, message: str, *, source: str = "", field: str = "") -> None:
        where = ": ".join(part for part in (source, field) if part)
        super().__init__(f"{where}: {message}" if where else message)
        self.source, self.field = source, field


class SandboxError(ProducerError):
    """Root of the sandboxes' errors."""


class SandboxSpecError(SandboxError, ValueError):
    """A value out of bounds; ``field`` names it (``limits.memory``, ``labels.stage``, ``env``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class SandboxUnavailable(SandboxError):
    """This kind of sandbox cannot run here (a tool or daemon missing, namespaces disabled)."""


class SandboxStateError(SandboxError):
    """The sandbox was destroyed, or what backs it is gone."""


class SandboxFileError(SandboxError):
    """copy_in / copy_out failed: outside the workdir, missing, not a file, or too large."""


class SandboxExecError(SandboxError):
    """The command could not be started (a non-zero exit or a timeout is an ExecResult)."""


# --------------------------------------------------------------------------- the rollout service


class JobSpecError(ProducerError, ValueError):
    """A job spec that cannot be used; ``field`` is the path of the offending value
    (``agent.max_turns``, ``tasks.inline[2].prompt``) and ``source`` the file, where known."""

    def __init__(self, message: str, *, field: str = "", source: str = "") -> None:
        where = ": ".join(part for part in (source, field) if part)
        super().__init__(f"{where}: {message}" if where else message)
        self.field, self.source, self.message = field, source, message


class AgentError(ProducerError, ValueError):
    """An agent that cannot be built from its options."""


class EvaluatorError(ProducerError, ValueError):
    """An evaluator that cannot be built (its function cannot be imported, or is no callable)."""


class RolloutCallError(ProducerError):
    """A call to the proxy's rollout API got no answer, or a refusal; ``status`` is the HTTP
    status it answered (None: no answer), ``code`` the error code of its answer ("" if none)."""

    def __init__(self, message: str, *, status: int | None = None, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class RolloutExists(RolloutCallError):
    """The proxy has (or had) a rollout with this id: the stage message was delivered again."""


class JobQueueError(ProducerError):
    """The job queue's topics (rollout.jobs, rollout.tasks.*, rollout.events) cannot be read or
    written: the broker unreachable, a record not acknowledged, a read past its timeout."""


class JobExists(JobQueueError):
    """A job with this id was submitted already (the same spec has the same id)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} was submitted already")
        self.job_id = job_id


class JobNotFound(JobQueueError):
    """No job with this id was submitted (in this namespace)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r} was submitted")
        self.job_id = job_id
