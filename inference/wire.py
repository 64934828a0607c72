"""vLLM's OpenAI-compatible wire format, as the reference server speaks it: request bodies
checked and turned into prompts and ``SamplingParams``, results turned into response bodies.

Plain functions over JSON-able dicts (no HTTP here); every refusal is a ``RequestRefused``
carrying the HTTP status and the offending parameter, answered with ``error_body``.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from rollstream.inference.errors import RequestRefused
from rollstream.inference.tinymodel import GenerationResult, SamplingParams

__all__ = [
    "MAX_TOP_LOGPROBS",
    "IncrementalText",
    "chat_body",
    "chat_prompt",
    "check_model",
    "completion_body",
    "completion_chunk",
    "error_body",
    "number",
    "parse_json",
    "prompts",
    "sampling",
    "stream_options",
    "usage_chunk",
]

MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's ErrorResponse: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = {404: "NotFoundError", 409: "ConflictError", 413: "RequestTooLargeError"}.get(
        status, "InternalServerError" if status >= 500 else "BadRequestError"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def parse_json(raw: bytes, limit: int = 64 * 1024) -> dict[str, Any]:
    """A request body: a JSON object of at most ``limit`` bytes (an empty body is ``{}``)."""
    if len(raw) > limit:
        raise RequestRefused(f"request body over {limit} bytes", status=413)
    try:
        data = json.loads(raw or b"{}")
    except json.JSONDecodeError as exc:
        raise RequestRefused(f"invalid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise RequestRefused("the request body must be a JSON object")
    return data


def number(
    body: dict[str, Any], key: str, default: Any, kind: type = int, lo: float | None = None
) -> Any:
    """``body[key]`` as an int (or a float with ``kind=float``), ``default`` when absent."""
    value = body.get(key)
    if value is None:
        return default
    ok = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        raise RequestRefused(
            f"`{key}` must be {'an integer' if kind is int else 'a number'}", param=key
        )
    if isinstance(value, float) and not math.isfinite(value):  # NaN, Infinity: JSON-ish
        raise RequestRefused(f"`{key}` must be a finite number", param=key)
    if lo is not None and value < lo:
        raise RequestRefused(f"`{key}` must be >= {lo}", param=key)
    if isinstance(value, int) and abs(value) > 2**53 - 1:  # JSON-safe ints
        raise RequestRefused(f"`{key}` must be within ±(2**53 - 1)", param=key)
    return kind(value)


def _checked_ids(ids: list[int], vocab: int, param: str) -> list[int]:
    if not ids:
        raise RequestRefused("empty prompt", param=param)
    if min(ids) < 0 or max(ids) >= vocab:
        raise RequestRefused(f"token id out of range [0, {vocab})", param=param)
    return ids


def prompts(body: dict[str, Any], tokenizer: Any, vocab: int) -> list[list[int]]:
    """A prompt is a list of token ids or a string; a list of either is a batch of prompts."""
    raw = body.get("prompt")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise RequestRefused("`prompt` must be token ids, a string, or a list of them", "prompt")
    out: list[list[int]] = []
    for item in raw:
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=True)
        elif isinstance(item, list) and all(type(t) is int for t in item):
            ids = item
        else:
            raise RequestRefused("`prompt` must hold token ids or strings", param="prompt")
        out.append(_checked_ids(ids, vocab, "prompt"))
    return out


def check_model(body: dict[str, Any], model_name: str) -> None:
    if body.get("model") not in (None, model_name):
        msg = f"The model `{body['model']}` does not exist."
        raise RequestRefused(msg, status=404, param="model")


def chat_prompt(body: dict[str, Any], tokenizer: Any, vocab: int, model_name: str) -> list[int]:
    """The token ids of a chat request's messages, rendered with the model's template."""
    check_model(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestRefused("`messages` must be a non-empty list", param="messages")
    for m in messages:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise RequestRefused(
                "each message needs a string `role` and a string `content`", param="messages"
            )
    if body.get("tools"):
        raise RequestRefused(
            "`tools` is not supported by the reference server's chat route", param="tools"
        )
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    return _checked_ids(prompt, vocab, "messages")


def sampling(body: dict[str, Any], max_len: int, longest: int, seed: int) -> SamplingParams:
    """The request's sampling parameters; ``seed`` when it sends none; ``longest`` prompt."""
    if (n := number(body, "n", 1)) != 1:
        raise RequestRefused(f"only n=1 is supported, got {n}", param="n")
    for flag in ("echo", "use_beam_search"):
        if body.get(flag):
            raise RequestRefused(f"`{flag}` is not supported by the reference server", flag)
    max_tokens: int = number(body, "max_tokens", 16, lo=1)
    temperature = number(body, "temperature", 1.0, float, lo=0)
    top_p = number(body, "top_p", 1.0, float)
    if not 0 < top_p <= 1:
        raise RequestRefused("`top_p` must be in (0, 1]", param="top_p")
    top = number(body, "logprobs", 0, lo=0)
    if top > MAX_TOP_LOGPROBS:
        raise RequestRefused(f"`logprobs` must be <= {MAX_TOP_LOGPROBS}", param="logprobs")
    stops = body.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(type(t) is int for t in stops):
        raise RequestRefused("`stop_token_ids` must be a list of token ids", "stop_token_ids")
    if longest + max_tokens > max_len:
        raise RequestRefused(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
            "completion).",
            param="max_tokens",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=number(body, "seed", seed),
        stop_token_ids=tuple(stops),
        ignore_eos=bool(body.get("ignore_eos", False)),
        top_logprobs=top,
    )


def _logprobs_body(
    r: GenerationResult, token_str: Callable[[int], str], want_top: bool
) -> dict[str, Any]:
    """vLLM's CompletionLogProbs: each step's top_logprobs holds the top-k and the sampled."""
    tokens = [token_str(t) for t in r.token_ids]
    offsets = [sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
    top = [
        {**({token_str(a): v for a, v in r.top_logprobs[i]} if want_top else {}), tokens[i]: lp}
        for i, lp in enumerate(r.logprobs)
    ]
    return {
        "text_offset": offsets,
        "token_logprobs": r.logprobs,
        "tokens": tokens,
        "top_logprobs": top,
    }


def _usage(n_in: int, n_out: int) -> dict[str, int]:
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def completion_body(
    body: dict[str, Any],
    prompts: Sequence[list[int]],
    params: SamplingParams,
    outs: Sequence[tuple[GenerationResult, int]],
    tokenizer: Any,
    model_name: str,
) -> dict[str, Any]:
    """A text_completion for ``prompts`` and their ``(result, policy version)`` outcomes;
    ``policy_version`` (a rollstream extension) is the oldest version that served one."""
    as_ids, want_ids = body.get("return_tokens_as_token_ids"), body.get("return_token_ids")
    skip_special = body.get("skip_special_tokens", True) is not False
    want_logprobs = body.get("logprobs") is not None

    def token_str(t: int) -> str:
        return f"token_id:{t}" if as_ids else str(tokenizer.decode([t]))

    choices = [
        {
            "index": i,
            "text": str(tokenizer.decode(r.token_ids, skip_special_tokens=skip_special)),
            "logprobs": (
                _logprobs_body(r, token_str, params.top_logprobs > 0) if want_logprobs else None
            ),
            "finish_reason": r.finish_reason,
            "stop_reason": r.stop_reason,
            "token_ids": r.token_ids if want_ids else None,
            "prompt_token_ids": prompt if want_ids else None,
        }
        for i, (prompt, (r, _)) in enumerate(zip(prompts, outs, strict=True))
    ]
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": _usage(sum(map(len, prompts)), sum(len(r.token_ids) for r, _ in outs)),
        "policy_version": min(v for _, v in outs),
    }


def chat_body(
    prompt: list[int], result: GenerationResult, version: int, tokenizer: Any, model_name: str
) -> dict[str, Any]:
    """A chat.completion with one choice: the completion's text as the assistant's reply."""
    text = str(tokenizer.decode(result.token_ids, skip_special_tokens=True))
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": result.finish_reason,
            }
        ],
        "usage": _usage(len(prompt), len(result.token_ids)),
        "policy_version": version,
    }


# --------------------------------------------------------------------------- streaming


def stream_flag(body: dict[str, Any]) -> bool:
    """The request's ``stream`` (False when absent); 400 when it is not a boolean."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestRefused("`stream` must be a boolean", param="stream")
    return stream


def stream_options(body: dict[str, Any]) -> bool:
    """Whether a streamed request asked for the usage chunk (``stream_options.include_usage``,
    as vLLM reads it); 400 on a ``stream_options`` that is not an object."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise RequestRefused("`stream_options` must be an object", param="stream_options")
    return bool(opts.get("include_usage"))


class IncrementalText:
    """Text of a growing list of token ids, handed out in pieces as the ids come: a piece is
    given only once it decodes to complete UTF-8 (a character split across byte-level tokens
    waits for its last byte), as vLLM's incremental detokenizer does. Only a window of recent
    ids is decoded per token. ``flush()`` at the end gives what is left, complete or not, so
    the pieces joined equal ``decode(ids)``."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._decode = tokenizer.decode
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # the window starts here
        self._read = 0  # ids up to here are handed out as text

    def _text(self, ids: list[int]) -> str:
        return str(self._decode(ids, skip_special_tokens=self._skip))

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self._text(self.ids[self._prefix : self._read])
        after = self._text(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        before = self._text(self.ids[self._prefix : self._read])
        after = self._text(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


def completion_chunk(
    head: dict[str, Any],
    body: dict[str, Any],
    step: Any,
    text: str,
    offset: int,
    prompt: list[int] | None,
    tokenizer: Any,
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk, as vLLM sends it per step: ``text`` (the new
    complete text), ``token_ids`` (the step's id, with ``return_token_ids``),
    ``prompt_token_ids`` (first chunk only), ``logprobs`` for the step (``text_offset`` counts
    the text sent before), ``finish_reason`` / ``stop_reason`` on the last token's chunk.
    ``step`` is an engine.TokenStep; ``policy_version`` rides on every chunk (rollstream)."""
    as_ids, want_ids = body.get("return_tokens_as_token_ids"), body.get("return_token_ids")

    def token_str(t: int) -> str:
        return f"token_id:{t}" if as_ids else str(tokenizer.decode([t]))

    logprobs = None
    if body.get("logprobs") is not None:
        token = token_str(step.token_id)
        top = {token_str(a): v for a, v in (step.top_logprobs or [])}
        top[token] = step.logprob
        logprobs = {
            "text_offset": [offset],
            "token_logprobs": [step.logprob],
            "tokens": [token],
            "top_logprobs": [top],
        }
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": step.finish_reason,
        "stop_reason": step.stop_reason,
    }
    if want_ids:
        choice["token_ids"] = [step.token_id]
        if prompt is not None:
            choice["prompt_token_ids"] = prompt
    return {**head, "choices": [choice], "policy_version": step.policy_version}


def chat_chunk(
    head: dict[str, Any],
    content: str,
    finish_reason: str | None,
    policy_version: int,
    *,
    role: bool = False,
) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk``, as vLLM sends it: the first with the role and
    empty content, then the new text of each step, the finish reason on the last token's.
    ``policy_version`` rides on every chunk (rollstream)."""
    delta: dict[str, Any] = (
        {"role": "assistant", "content": content} if role else {"content": content}
    )
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {**head, "choices": [choice], "policy_version": policy_version}


def usage_chunk(head: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The usage chunk after the last token (``stream_options.include_usage``)."""
    return {**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)}
