"""The tiny reference model: tokenizer, chat template, weights, and the sampling loop."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rollstream.inference.tinymodel import (
    CHAT_TEMPLATE,
    DEFAULT_CORPUS,
    SPECIAL_TOKENS,
    CheckpointError,
    GenerationError,
    SamplingParams,
    apply_state_dict,
    ensure_tiny_model,
    generate,
    load_model,
    load_state_dict,
    make_tiny_model,
    stop_token_ids,
    train_tokenizer,
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "List the files."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "shell", "arguments": {"command": "ls"}}},
            {"type": "function", "function": {"name": "cat", "arguments": '{"path": "a.py"}'}},
        ],
    },
    {"role": "tool", "content": "a.py"},
    {"role": "assistant", "content": "One file: a.py."},
]
EXPECTED = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nList the files.<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "cat", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>tool\na.py<|im_end|>\n"
    "<|im_start|>assistant\nOne file: a.py.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Two intra-op threads on a shared 2-core machine stall under contention (OpenMP spin)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return train_tokenizer(DEFAULT_CORPUS, vocab_size=512)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, tok: PreTrainedTokenizerFast) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, hidden=64, tokenizer=tok)


@pytest.fixture(scope="module")
def loaded(tiny: Path) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    return load_model(tiny)


def _gen(model, tok, prompts, params, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("eos_token_ids", stop_token_ids(tok))
    return generate(model, prompts, params, pad_token_id=tok.pad_token_id, **kw)


# --------------------------------------------------------------------------- tokenizer


def test_vocab_size_and_single_id_special_tokens(tok: PreTrainedTokenizerFast) -> None:
    assert len(tok) == 512
    for t in (*SPECIAL_TOKENS, "<tool_call>", "</tool_call>"):
        assert len(tok.encode(t)) == 1, t
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert set(stop_token_ids(tok)) == {tok.eos_token_id, tok.pad_token_id}


@pytest.mark.parametrize(
    "text",
    [
        "The agent reads the task, plans, and calls a tool.",
        "def add(a: int, b: int) -> int:\n    return a + b\n",
        "  leading and trailing spaces  \n\n\ttabs",
        "héllo wörld, 日本語, emoji 🎉, math ∑ x²",
        '{"name": "shell", "arguments": {"command": "ls -la"}}',
    ],
)
def test_round_trip(tok: PreTrainedTokenizerFast, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < len(tok) for i in ids)
    assert tok.decode(ids) == text


def test_chat_template_renders_chatml_with_tool_calls(tok: PreTrainedTokenizerFast) -> None:
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text == EXPECTED


def test_chat_template_tokenizes_to_the_encoded_text(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == tok.encode(EXPECTED)
    enc = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    assert enc["input_ids"] == ids  # transformers 5: a BatchEncoding by default
    assert tok.decode(ids) == EXPECTED


def test_chat_template_lists_tools_in_the_system_turn(tok: PreTrainedTokenizerFast) -> None:
    tools = [{"type": "function", "function": {"name": "shell"}}]
    text = tok.apply_chat_template(CONVERSATION[:2], tools=tools, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n"
        '{"type": "function", "function": {"name": "shell"}}<|im_end|>\n'
        "<|im_start|>user\nList the files.<|im_end|>\n"
    )


def test_saved_tokenizer_loads_back_identically(tiny: Path, tok: PreTrainedTokenizerFast) -> None:
    again = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    assert again.chat_template == CHAT_TEMPLATE
    assert again.encode(EXPECTED) == tok.encode(EXPECTED)
    assert again.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == (
        EXPECTED
    )


# --------------------------------------------------------------------------- model + weights


def test_default_model_is_a_427k_qwen2(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    model, _ = load_model(make_tiny_model(tmp_path / "m", tokenizer=tok))
    assert type(model).__name__ == "Qwen2ForCausalLM"
    n = sum(p.numel() for p in model.parameters())
    assert n == 427_136  # hidden 128, 2 layers, 4 heads / 2 kv heads, mlp 256, vocab 512


def test_same_seed_same_weights(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    sd = []
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        model, _ = load_model(make_tiny_model(tmp_path / name, seed=seed, hidden=32, tokenizer=tok))
        sd.append(model.state_dict())
    assert all(torch.equal(sd[0][k], sd[1][k]) for k in sd[0])
    assert not all(torch.equal(sd[0][k], sd[2][k]) for k in sd[0])


def test_ensure_tiny_model_is_idempotent(tmp_path: Path) -> None:
    target = tmp_path / "models" / "tiny"
    assert ensure_tiny_model(target, hidden=32) == target
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(target, hidden=32) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    assert os.listdir(tmp_path / "models") == ["tiny"]  # no temporary folder left behind


def test_load_model_without_a_checkpoint_raises(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError):
        load_model(tmp_path)


def test_state_dict_files_and_dirs_apply(tmp_path: Path, tiny: Path) -> None:
    model, _ = load_model(tiny)
    new = {k: v + 0.01 for k, v in model.state_dict().items()}
    save_file(new, str(tmp_path / "w.safetensors"))
    torch.save(new, tmp_path / "w.pt")
    for path in (tmp_path / "w.safetensors", tmp_path / "w.pt"):
        fresh, _ = load_model(tiny)
        apply_state_dict(fresh, load_state_dict(path))
        assert all(torch.allclose(fresh.state_dict()[k], new[k]) for k in new)
    assert set(load_state_dict(tiny)) == set(new)  # a checkpoint directory


def test_bad_checkpoint_leaves_the_model_untouched(tmp_path: Path, tiny: Path) -> None:
    model, _ = load_model(tiny)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = {k: v + 1 for k, v in before.items()}
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(CheckpointError, match="shapes"):
        apply_state_dict(model, bad)
    with pytest.raises(CheckpointError, match="unexpected"):
        apply_state_dict(model, {**before, "extra.weight": torch.ones(1)})
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    with pytest.raises(CheckpointError):
        load_state_dict(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(CheckpointError):
        load_state_dict(tmp_path / "junk.safetensors")


# --------------------------------------------------------------------------- sampling


def test_same_seed_same_tokens_different_seed_different(loaded) -> None:  # type: ignore[no-untyped-def]
    model, tok = loaded
    prompt = tok.encode("The agent reads the task")
    runs = [
        _gen(model, tok, [prompt], [SamplingParams(max_tokens=24, seed=s, ignore_eos=True)])[0]
        for s in (7, 7, 8)
    ]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].logprobs == runs[1].logprobs
    assert runs[0].token_ids != runs[2].token_ids
    assert len(runs[0].token_ids) == 24 and runs[0].finish_reason == "length"


def test_batching_does_not_change_a_request(loaded) -> None:  # type: ignore[no-untyped-def]
    model, tok = loaded
    short, long = tok.encode("Hi"), tok.encode("The proxy pauses new requests and drains")
    sp = [SamplingParams(max_tokens=16, seed=1), SamplingParams(max_tokens=9, seed=2, top_p=0.9)]
    alone = [_gen(model, tok, [p], [s])[0] for p, s in zip((short, long), sp, strict=True)]
    together = _gen(model, tok, [short, long], sp)
    for a, b in zip(alone, together, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_logprobs_match_a_plain_forward_pass(loaded, mode: str) -> None:  # type: ignore[no-untyped-def]
    model, tok = loaded
    prompt, temp = tok.encode("Read the file, find the function"), 0.7
    sp = SamplingParams(max_tokens=20, temperature=temp, top_p=0.95, seed=5, ignore_eos=True)
    r = _gen(model, tok, [prompt], [sp], logprobs_mode=mode)[0]
    full = torch.tensor([prompt + r.token_ids])
    with torch.no_grad():
        logits = model(full).logits[0, len(prompt) - 1 : -1].float()  # (N, V)
    scale = temp if mode == "processed_logprobs" else 1.0
    expected = F.log_softmax(logits / scale, dim=-1).gather(-1, torch.tensor(r.token_ids)[:, None])
    assert r.logprobs == pytest.approx(expected.squeeze(-1).tolist(), abs=1e-4)
    assert all(lp <= 0 for lp in r.logprobs)


def test_greedy_is_argmax_and_ignores_the_seed(loaded) -> None:  # type: ignore[no-untyped-def]
    model, tok = loaded
    prompt = tok.encode("def add(a, b):")
    outs = [
        _gen(model, tok, [prompt], [SamplingParams(max_tokens=8, temperature=0, seed=s)])[0]
        for s in (1, 2)
    ]
    assert outs[0].token_ids == outs[1].token_ids
    seq = list(prompt)
    with torch.no_grad():
        for t in outs[0].token_ids:
            assert int(model(torch.tensor([seq])).logits[0, -1].argmax()) == t
            seq.append(t)
    tiny_top_p = SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=9)
    assert _gen(model, tok, [prompt], [tiny_top_p])[0].token_ids == outs[0].token_ids


def test_stop_tokens_end_and_are_included(loaded) -> None:  # type: ignore[no-untyped-def]
    model, tok = loaded
    prompt = tok.encode("The answer is")
    first = _gen(model, tok, [prompt], [SamplingParams(max_tokens=4, temperature=0)])[0]
    stop = first.token_ids[0]
    r = _gen(model, tok, [prompt], [SamplingParams(8, temperature=0, stop_token_ids=(stop,))])[0]
    assert (r.token_ids, r.finish_reason, r.stop_reason) == ([stop], "stop", stop)
    eos = _gen(model, tok, [prompt], [SamplingParams(8, temperature=0)], eos_token_ids=[stop])[0]
    assert (eos.token_ids, eos.finish_reason, eos.stop_reason) == ([stop], "stop", None)
    ignored = SamplingParams(3, temperature=0, ignore_eos=True)
    assert len(_gen(model, tok, [prompt], [ignored], eos_token_ids=[stop])[0].token_ids) == 3


def test_abort_and_top_logprobs(loaded) -> None:  # type: ignore[no-untyped-def]
    model, tok = loaded
    prompt = tok.encode("Q: What is a branch?")
    r = _gen(model, tok, [prompt], [SamplingParams(50, seed=1)], should_abort=lambda: True)[0]
    assert (len(r.token_ids), r.finish_reason) == (1, "abort")
    r = _gen(model, tok, [prompt], [SamplingParams(5, seed=1, top_logprobs=3)])[0]
    assert [len(t) for t in r.top_logprobs] == [3] * len(r.token_ids)
    for alts, lp in zip(r.top_logprobs, r.logprobs, strict=True):
        values = [v for _, v in alts]
        assert values == sorted(values, reverse=True) and lp <= values[0] + 1e-6


def test_invalid_requests_raise(loaded) -> None:  # type: ignore[no-untyped-def]
    model, tok = loaded
    for prompts, sp in [
        ([[]], SamplingParams()),
        ([[len(tok)]], SamplingParams()),
        ([[1, 2]], SamplingParams(max_tokens=0)),
        ([[1, 2]], SamplingParams(top_p=0)),
        ([[1, 2]], SamplingParams(temperature=-1)),
    ]:
        with pytest.raises(GenerationError):
            _gen(model, tok, prompts, [sp])
