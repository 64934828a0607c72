"""Bytes a 50-turn append-only rollout costs on Kafka (our encoded events, delta-encoded through
the context trie) vs a logging proxy that stores the full request and response of every call.

Each turn the harness adds a user message of --turn-tokens tokens and the model answers with
--turn-tokens tokens (+ the stop token). Two tokenizations:
  tiny       the proxy's real path: the tiny model's chat template and BPE tokenizer (vocab 512,
             so ~2 characters per token), messages rendered with render_prompt + ChatMemory,
             replies spliced back as generated ids; text drawn from the tiny model's corpus
  bpe150k    what a production model looks like: ids from a 150k vocabulary (Zipf) and
             ~4 characters of text per token (typical of GPT/Qwen BPE on English); ChatML
             framing tokens around each message as in the real template
Ours: every event the Recorder hands to Kafka for the rollout (RolloutStarted, 50 LlmCalls,
RolloutFinished), Avro single-object encoded, key included: uncompressed
(``compression="none"``), and as stored with ``compression="zstd"`` (the SDK's default) /
``"lz4"`` (each event
compressed alone, zstd level 3 / LZ4 frame as librdkafka does: a live rollout's events are
seconds apart, so each is its own record batch; batch headers not counted). Logging proxy, per
call: the request JSON (model, all messages so far) + the response JSON (the reply), and, since
an RL trainer needs them, the same with the reply's logprobs in OpenAI's format
(``logprobs.content[] = {token, logprob, bytes, top_logprobs}``).

    .venv/bin/python bench/bench_wire_bytes.py [--quick] [--turns 50] [--turn-tokens 200]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import cramjam
import numpy as np

from rollstream.producers import MemoryTransport, Recorder, RecorderSettings
from rollstream.producers.proxy.chat import (
    ChatMemory,
    ChatTemplate,
    normalize_messages,
    parse_reply,
    render_prompt,
)

ROOT = Path(__file__).resolve().parents[1]


def recorder() -> tuple[Recorder, MemoryTransport]:
    transport = MemoryTransport()
    settings = RecorderSettings(spool_dir=None, producer="proxy@bench", namespace="wire")
    return Recorder(settings, transport=transport), transport


def wire_bytes(rec: Recorder, transport: MemoryTransport) -> dict[str, int]:
    """Bytes of the rollout's records: uncompressed, and each compressed alone."""
    assert rec.flush(30)
    records = [(m.key or b"") + m.value for m in transport.messages(rec.topic)]
    return {
        "none": sum(map(len, records)),
        "zstd": sum(len(cramjam.zstd.compress(r, level=3)) for r in records),
        "lz4": sum(len(cramjam.lz4.compress(r)) for r in records),
    }


def log_bytes(messages: list[dict[str, Any]], reply: str, tokens: list[str], lps: list[float],
              with_logprobs: bool) -> int:  # fmt: skip
    request = {"model": "policy", "messages": messages, "max_tokens": 1024, "temperature": 1.0}
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": reply}}  # fmt: skip
    if with_logprobs:
        choice["logprobs"] = {"content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, lps, strict=True)]}  # fmt: skip
    response = {"id": "chatcmpl-01J00000000000000000000000", "object": "chat.completion",
                "created": 1760000000, "model": "policy", "choices": [choice],
                "usage": {"prompt_tokens": 0, "completion_tokens": len(tokens)}}  # fmt: skip
    return len(json.dumps(request).encode()) + len(json.dumps(response).encode())


def run_tiny(turns: int, n: int) -> dict[str, Any]:
    path = ROOT / ".rollstream" / "models" / "tiny"
    if not (path / "tokenizer.json").is_file():
        from rollstream.inference.tinymodel import ensure_tiny_model

        ensure_tiny_model(path)
    chat = ChatTemplate.from_dir(path)
    words = (
        (ROOT / "inference" / "data" / "corpus.txt").read_text().split()
    )  # tinymodel.DEFAULT_CORPUS
    rng = np.random.default_rng(0)

    def text_of(tokens: int) -> tuple[str, np.ndarray]:
        start = int(rng.integers(0, len(words) - 4 * tokens))
        ids = chat.encode(" ".join(words[start : start + 4 * tokens]))[:tokens]
        text = chat.decode(ids)
        return text, chat.encode(text)

    rec, transport = recorder()
    mem = ChatMemory()
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful agent."}]
    plain = logged = chars = 0
    with rec.rollout(task_id="wire", group_id="g") as r:
        for turn in range(turns):
            user, _ = text_of(n)
            msgs.append({"role": "user", "content": user})
            prompt = render_prompt(chat, mem, normalize_messages(msgs))
            _, ids = text_of(n)
            gen = np.concatenate([ids, np.array([chat.eos_id], np.uint32)])
            lps = rng.normal(-1.0, 0.5, len(gen)).astype(np.float32)
            call = r.llm_call(prompt.ids, gen, lps, model="policy", backend="b0")
            reply = parse_reply(chat, gen, tools_enabled=False)
            mem.remember(len(msgs), reply, gen, call)
            toks = [chat.decode([t], skip_special_tokens=False) for t in gen.tolist()]
            plain += log_bytes(msgs, reply.content or "", toks, lps.tolist(), False)
            logged += log_bytes(msgs, reply.content or "", toks, lps.tolist(), True)
            chars += len(user) + len(reply.content or "")
            msgs.append(reply.message())
            del turn
    ours = wire_bytes(rec, transport)
    rec.close(5)
    return {"ours": ours["none"], "ours_zstd": ours["zstd"], "ours_lz4": ours["lz4"],
            "log": plain, "log_lp": logged,
            "chars_per_token": round(chars / (2 * turns * n), 2)}  # fmt: skip


def run_bpe(turns: int, n: int, chars_per_token: float = 4.0) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    vocab = 150_000
    im_start, im_end, nl = 151_644, 151_645, 198  # Qwen2's ChatML ids

    def tokens(k: int) -> np.ndarray:
        return (rng.zipf(1.2, k) % vocab).astype(np.uint32)

    def text(ids: np.ndarray) -> str:  # ~chars_per_token characters per token, word-like
        return " ".join("w" * max(1, int(chars_per_token) - 1) for _ in range(len(ids)))

    def frame(role_id: int, body: np.ndarray) -> np.ndarray:
        return np.concatenate([[im_start, role_id, nl], body, [im_end, nl]]).astype(np.uint32)

    rec, transport = recorder()
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful agent."}]
    prompt = frame(8948, tokens(6))
    plain = logged = 0
    with rec.rollout(task_id="wire", group_id="g") as r:
        for _ in range(turns):
            user = tokens(n)
            msgs.append({"role": "user", "content": text(user)})
            prompt = np.concatenate([prompt, frame(872, user), [im_start, 77091, nl]])
            gen = np.concatenate([tokens(n), [im_end]]).astype(np.uint32)
            lps = rng.normal(-1.0, 0.5, len(gen)).astype(np.float32)
            r.llm_call(prompt, gen, lps, model="policy", backend="b0")
            reply = text(gen[:-1])
            toks = ["w" * max(1, int(chars_per_token) - 1)] * len(gen)
            plain += log_bytes(msgs, reply, toks, lps.tolist(), False)
            logged += log_bytes(msgs, reply, toks, lps.tolist(), True)
            msgs.append({"role": "assistant", "content": reply})
            prompt = np.concatenate([prompt, gen, [nl]]).astype(np.uint32)
    ours = wire_bytes(rec, transport)
    rec.close(5)
    return {"ours": ours["none"], "ours_zstd": ours["zstd"], "ours_lz4": ours["lz4"],
            "log": plain, "log_lp": logged, "chars_per_token": chars_per_token}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the same figures (they are cheap)")
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--turn-tokens", type=int, default=200)
    args = ap.parse_args()
    default = RecorderSettings.model_fields["compression"].default
    out: dict[str, Any] = {"turns": args.turns, "turn_tokens": args.turn_tokens,
                           "sdk_default_compression": default}  # fmt: skip
    print(f"{'tokenizer':9} {'ours as':8} {'ours KB':>9} {'log KB':>9} {'ratio':>7} "
          f"{'log+lp KB':>10} {'ratio':>7}")  # fmt: skip
    for name, res in (("tiny", run_tiny(args.turns, args.turn_tokens)),
                      ("bpe150k", run_bpe(args.turns, args.turn_tokens))):  # fmt: skip
        out |= {f"{name}_log_bytes": res["log"], f"{name}_log_logprobs_bytes": res["log_lp"],
                f"{name}_chars_per_token": res["chars_per_token"]}  # fmt: skip
        for comp, key in (("none", "ours"), ("zstd", "ours_zstd"), ("lz4", "ours_lz4")):
            ours = res[key]
            ratio, ratio_lp = res["log"] / ours, res["log_lp"] / ours
            print(f"{name:9} {comp:8} {ours / 1e3:9.1f} {res['log'] / 1e3:9.1f} {ratio:7.1f} "
                  f"{res['log_lp'] / 1e3:10.1f} {ratio_lp:7.1f}")  # fmt: skip
            tag = "" if comp == "none" else f"_{comp}"
            out |= {f"{name}_ours{tag}_bytes": ours, f"{name}_ratio{tag}": round(ratio, 2),
                    f"{name}_ratio{tag}_logprobs": round(ratio_lp, 2)}  # fmt: skip
            if comp == default:
                out[f"{name}_ratio_sdk_default"] = round(ratio, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
