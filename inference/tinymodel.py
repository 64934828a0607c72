"""The tiny reference model: a local byte-level BPE tokenizer, a random Qwen2-style causal LM,
and the batched sampling loop that the reference inference server runs.

Everything is made on this machine; nothing here touches a model hub. The layout on disk is a
plain transformers checkpoint (``config.json``, ``model.safetensors``, tokenizer files and a
ChatML ``chat_template.jinja``), so ``AutoModelForCausalLM.from_pretrained(path)`` and vLLM load
it too.

Sampling and logprobs (``generate``), per request:
- the request's own ``torch.Generator`` (seeded with its seed) draws one uniform number per
  decoding step, and the token is picked by inverse CDF over the (top-p truncated) distribution.
  The draws do not depend on the other requests in the batch, so a (seed, prompt) pair gives the
  same tokens alone or batched;
- ``temperature == 0`` is greedy (argmax); no random number is used;
- the returned logprob of each sampled token is, with ``logprobs_mode="processed_logprobs"``
  (the default), ``log_softmax(logits / temperature)`` at the sampled token: temperature is
  applied, top-p truncation is NOT (the trainer recomputes exactly this from a plain forward
  pass). With ``"raw_logprobs"`` (vLLM's default mode) it is ``log_softmax(logits)``. At
  ``temperature == 0`` both modes use ``log_softmax(logits)``;
- a stop token (EOS or one of ``stop_token_ids``) ends the sequence and IS part of the returned
  tokens and logprobs (the policy must learn to emit it).

Errors: ``TinyModelError`` and its ``CheckpointError`` and ``GenerationError``, in the
package's tree (rollstream.inference.errors).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.utils import logging as hf_logging

from rollstream.inference.errors import CheckpointError, GenerationError, TinyModelError
from rollstream.inference.settings import LogprobsMode

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_CORPUS",
    "SPECIAL_TOKENS",
    "CheckpointError",
    "GenerationError",
    "GenerationResult",
    "LogprobsMode",
    "SamplingParams",
    "TinyModelError",
    "apply_state_dict",
    "ensure_tiny_model",
    "generate",
    "load_model",
    "load_state_dict",
    "make_tiny_model",
    "stop_token_ids",
    "train_tokenizer",
]

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Added (not special) tokens: one id each, and kept by decode(skip_special_tokens=True).
TOOL_TOKENS = ("<tool_call>", "</tool_call>")

# ChatML as Qwen2 writes it. Roles: system, user, assistant, tool. Assistant tool_calls are
# rendered as text, one <tool_call>{"name": ..., "arguments": ...}</tool_call> block per call.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0]['role'] == 'system' %}
{{- messages[0]['content'] + '\\n\\n' }}
{%- endif %}
{{- '# Tools' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if not (tools and loop.first and message['role'] == 'system') %}
{{- '<|im_start|>' + message['role'] + '\\n' }}
{%- if message['content'] is string %}{{- message['content'] }}
{%- elif message['content'] %}{%- for part in message['content'] %}{{- part['text'] }}{%- endfor %}
{%- endif %}
{%- if message['role'] == 'assistant' and message.get('tool_calls') %}
{%- for call in message['tool_calls'] %}
{%- set fn = call['function'] if call.get('function') else call %}
{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + fn['name'] + '", "arguments": ' }}
{%- if fn['arguments'] is string %}{{- fn['arguments'] }}
{%- else %}{{- fn['arguments'] | tojson }}
{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


# --------------------------------------------------------------------------- tokenizer + model


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers draws a progress bar per save and load; for a 2 MB model it is only noise
    on the console (and in service logs)."""
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def train_tokenizer(
    corpus_path: str | os.PathLike[str] = DEFAULT_CORPUS, vocab_size: int = 512
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on a local text file, with ChatML special tokens and
    the chat template. ``tok.apply_chat_template(messages, add_generation_prompt=True)``
    returns a BatchEncoding (transformers 5 default ``return_dict=True``); pass
    ``return_dict=False`` for a plain list of ids."""
    path = Path(corpus_path)
    if not path.is_file():
        raise TinyModelError(f"tokenizer corpus not found: {path}")
    bpe = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),  # the tool tags are added after training
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train([str(path)], trainer)
    bpe.add_tokens(list(TOOL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _qwen2_config(
    tok: PreTrainedTokenizerFast,
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    max_positions: int,
) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=stop_token_ids(tok),
        pad_token_id=tok.pad_token_id,
    )


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    hidden: int = 128,
    layers: int = 2,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab_size: int = 512,
    max_positions: int = 2048,
    corpus_path: str | os.PathLike[str] = DEFAULT_CORPUS,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Randomly initialise (with ``seed``) a Qwen2ForCausalLM and save it with its tokenizer
    into ``out_dir``. Defaults give ~427k parameters. Returns ``out_dir``."""
    tok = tokenizer if tokenizer is not None else train_tokenizer(corpus_path, vocab_size)
    config = _qwen2_config(
        tok,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate or 2 * hidden,
        max_positions=max_positions,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _no_progress_bars():
        model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "rollstream.json").write_text(json.dumps({"seed": seed, "policy_version": 0}))
    return out


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file()


def ensure_tiny_model(path: str | os.PathLike[str], seed: int = 0, **kwargs: object) -> Path:
    """Create the tiny model at ``path`` unless one is there (idempotent). It is built in a
    temporary sibling folder and renamed into place, so a crash never leaves half a model."""
    target = Path(path)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        make_tiny_model(tmp, seed=seed, **kwargs)  # type: ignore[arg-type]
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race: keep theirs
            if not _is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_model(
    path: str | os.PathLike[str], *, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load a local checkpoint directory: (model in eval mode, tokenizer). Never downloads."""
    p = Path(path)
    if not _is_complete(p):
        raise CheckpointError(f"no model checkpoint (config.json + tokenizer.json) at {p}")
    tok = PreTrainedTokenizerFast.from_pretrained(p, local_files_only=True)
    with _no_progress_bars():
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            p, dtype=dtype, local_files_only=True
        )
    model.to(torch.device(device))  # type: ignore[arg-type]  # transformers' typed wrapper
    return model.eval(), tok


def stop_token_ids(tok: PreTrainedTokenizerFast) -> list[int]:
    """Token ids that end a completion by default: <|im_end|> and <|endoftext|>."""
    ids = [tok.convert_tokens_to_ids(t) for t in (IM_END, ENDOFTEXT)]
    return [i for i in ids if isinstance(i, int) and i >= 0]


# --------------------------------------------------------------------------- weights


def load_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read weights from a checkpoint directory (``*.safetensors`` or ``pytorch_model*.bin``)
    or from one ``.safetensors`` / ``.pt`` / ``.bin`` file holding a state dict."""
    from safetensors.torch import load_file

    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors")) or sorted(p.glob("pytorch_model*.bin"))
        if not files:
            raise CheckpointError(f"no *.safetensors or pytorch_model*.bin in {p}")
    elif p.is_file():
        files = [p]
    else:
        raise CheckpointError(f"weights path does not exist: {p}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        part: Any
        try:
            if f.suffix == ".safetensors":
                part = load_file(str(f))
            else:
                part = torch.load(f, map_location="cpu", weights_only=True)
                part = part.get("state_dict", part) if isinstance(part, dict) else part
        except Exception as exc:
            raise CheckpointError(f"cannot read weights from {f}: {exc}") from exc
        if not isinstance(part, dict) or not all(
            isinstance(v, torch.Tensor) for v in part.values()
        ):
            raise CheckpointError(f"{f} does not hold a state dict of tensors")
        state.update(part)
    return state


def apply_state_dict(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model`` in place. Every key and shape is checked first, so a bad
    checkpoint leaves the model untouched. A ``model.`` prefix (trainer wrappers) is accepted."""
    current = model.state_dict()
    if state and not any(k in current for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    unexpected = sorted(k for k in state if k not in current)
    missing = sorted(k for k in current if k not in state)
    if getattr(model.config, "tie_word_embeddings", False):
        missing = [k for k in missing if k != "lm_head.weight"]
    bad_shapes = [
        f"{k}: {tuple(v.shape)} != {tuple(current[k].shape)}"
        for k, v in state.items()
        if k in current and v.shape != current[k].shape
    ]
    if unexpected or missing or bad_shapes:
        raise CheckpointError(
            "checkpoint does not fit the model: "
            f"missing={missing[:5]} unexpected={unexpected[:5]} shapes={bad_shapes[:5]}"
        )
    with torch.no_grad():
        for k, v in state.items():
            current[k].copy_(v.to(current[k].dtype))


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # how many alternatives to return per step (0: none)


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str = "length"  # stop | length | abort
    stop_reason: int | None = None  # the stop_token_ids entry that ended it (None for EOS)


def _check(prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], vocab: int) -> None:
    if len(prompts) != len(params) or not prompts:
        raise GenerationError("need one SamplingParams per prompt, and at least one prompt")
    for prompt, sp in zip(prompts, params, strict=True):
        if not prompt:
            raise GenerationError("empty prompt")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise GenerationError(f"prompt token id out of range [0, {vocab})")
        if sp.max_tokens < 1 or sp.temperature < 0 or not 0 < sp.top_p <= 1:
            raise GenerationError(f"invalid sampling parameters: {sp}")


@torch.inference_mode()
def generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    logprobs_mode: LogprobsMode = "processed_logprobs",
    should_abort: Callable[[], bool] | None = None,
    row_abort: Callable[[int], bool] | None = None,
    on_step: Callable[[list[tuple[int, GenerationResult, bool]]], None] | None = None,
) -> list[GenerationResult]:
    """Sample completions for a batch of token-id prompts with a KV cache (left padding).
    See the module docstring for the exact sampling and logprob definitions.

    ``should_abort()`` ends every row at the next step (finish_reason "abort");
    ``row_abort(i)`` ends row ``i`` only (a streaming client that went away), the others go on.
    ``on_step(rows)`` is called once per decoding step with ``(i, result_i, done)`` for every
    row that got a token in that step (its last token is ``result_i.token_ids[-1]``; ``done``:
    it was the row's last): how a streaming server hands out tokens as they are sampled."""
    vocab = int(model.config.vocab_size)
    _check(prompts, params, vocab)
    device = next(model.parameters()).device
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)

    gens = [torch.Generator().manual_seed(sp.seed % 2**63) for sp in params]
    temps = torch.tensor([sp.temperature if sp.temperature > 0 else 1.0 for sp in params])
    temps = temps.to(device).unsqueeze(-1)  # (B, 1)
    greedy = [sp.temperature == 0 for sp in params]
    stops = [
        set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_token_ids)) for sp in params
    ]
    results = [GenerationResult() for _ in params]
    live = list(range(n))

    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    cache, next_pos = out.past_key_values, pos[:, -1:] + 1  # (B, 1)
    logits = out.logits[:, -1, :].float()  # (B, V)
    for _step in range(max(sp.max_tokens for sp in params)):
        scaled = F.log_softmax(logits / temps, dim=-1)  # (B, V): the sampling distribution
        raw = logprobs_mode == "raw_logprobs"
        report = F.log_softmax(logits, dim=-1) if raw else scaled  # (B, V)
        chosen = _sample(scaled, params, gens, greedy, live)  # (B,)
        tokens = chosen.tolist()
        picked = report.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).tolist()
        kmax = max(params[i].top_logprobs for i in live)
        top = report.topk(min(kmax, vocab), dim=-1) if kmax else None
        aborting = should_abort is not None and should_abort()
        still: list[int] = []
        stepped: list[tuple[int, GenerationResult, bool]] = []
        for i in live:
            r, sp, tok = results[i], params[i], tokens[i]
            r.token_ids.append(tok)
            r.logprobs.append(picked[i])
            if top is not None and sp.top_logprobs:
                vals, idx = top.values[i, : sp.top_logprobs], top.indices[i, : sp.top_logprobs]
                r.top_logprobs.append(list(zip(idx.tolist(), vals.tolist(), strict=True)))
            if tok in stops[i]:
                r.finish_reason = "stop"
                r.stop_reason = tok if tok in sp.stop_token_ids else None
            elif len(r.token_ids) >= sp.max_tokens:
                r.finish_reason = "length"
            elif aborting or (row_abort is not None and row_abort(i)):
                r.finish_reason = "abort"
            else:
                still.append(i)
                stepped.append((i, r, False))
                continue
            stepped.append((i, r, True))
        if on_step is not None:
            on_step(stepped)
        live = still
        if not live:
            break
        step_ids = torch.full((n, 1), pad_token_id, dtype=torch.long, device=device)
        step_ids[:, 0] = chosen
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=device)], dim=-1)
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=next_pos,
            past_key_values=cache,
            use_cache=True,
        )
        cache, next_pos = out.past_key_values, next_pos + 1
        logits = out.logits[:, -1, :].float()
    return results


def _sample(
    logp: torch.Tensor,
    params: Sequence[SamplingParams],
    gens: Sequence[torch.Generator],
    greedy: Sequence[bool],
    live: Sequence[int],
) -> torch.Tensor:
    """Inverse-CDF sampling, one uniform draw per live non-greedy row from its own generator.
    logp: (B, V) log-probabilities at the request's temperature. Returns (B,) token ids."""
    chosen = logp.argmax(dim=-1)  # (B,): greedy rows and finished rows keep this
    rows = [i for i in live if not greedy[i]]
    if not rows:
        return chosen
    probs = logp[rows].exp()  # (R, V)
    sorted_p, order = probs.sort(dim=-1, descending=True)  # (R, V)
    top_p = torch.tensor([params[i].top_p for i in rows], device=logp.device).unsqueeze(-1)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p  # (R, V); the first token is always kept
    cdf = (sorted_p * keep).cumsum(-1)  # (R, V)
    u = torch.cat([torch.rand(1, generator=gens[i]) for i in rows]).to(logp.device)  # (R,)
    j = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True)  # (R, 1)
    j = j.clamp(max=cdf.shape[-1] - 1)
    chosen[rows] = order.gather(-1, j).squeeze(-1)
    return chosen
