"""Time of one training step (forward + PPO loss + backward + AdamW): path mode vs tree mode.

The same B leaf paths of T tokens are trained two ways: path mode, B samples of T tokens; tree
mode, the paths grouped by shared prefix into trees of one prefix and k branches, packed with an
ancestor mask. Both optimize the same objective (the first step's losses are reported and
must agree). Tokens/s counts path tokens (B * T) in both modes, so the ratio is the speed-up
of training the same data.

    .venv/bin/python bench/bench_train_step.py [--quick] [--device cpu|cuda] [--attn eager|sdpa]

Prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from typing import Any

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollstream.consumers.training.batching import collate
from rollstream.consumers.training.ppo import LossConfig, batch_loss
from rollstream.consumers.training.treepack import batch_token_logprobs
from rollstream.schemas.events import Sample, SampleMode


def build_model(vocab: int, hidden: int, layers: int, attn: str, device: str) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        attn_implementation=attn,  # type: ignore[call-arg]
    )
    model = Qwen2ForCausalLM(config)
    model.to(device)  # type: ignore[arg-type]
    return model


def _sample(
    sid: str,
    ids: np.ndarray,
    mask: np.ndarray,
    blp: np.ndarray,
    advantage: float,
    weight: float,
    parents: np.ndarray | None = None,
) -> Sample:
    return Sample(
        sample_id=sid,
        rollout_id=sid.split("/")[0],
        group_id="g",
        task_id="t",
        input_ids=ids.astype(np.uint32),
        loss_mask=mask.astype(np.uint8),
        behaviour_logprobs=(blp * mask).astype(np.float32),
        advantage=advantage,
        reward=0.0,
        policy_version=0,
        mode=SampleMode.PATH if parents is None else SampleMode.TREE,
        parent_indices=np.zeros(0, np.int32) if parents is None else parents.astype(np.int32),
        loss_weight=weight,
    )


def make_data(
    batch: int, seq: int, prefix: int, per_tree: int, vocab: int
) -> tuple[list[Sample], list[Sample]]:
    """``batch`` paths of ``seq`` tokens: trees of one ``prefix``-token prompt (loss mask 0)
    and ``per_tree`` generated branches; the same tokens as path samples."""
    rng = np.random.default_rng(0)
    branch = seq - prefix
    paths: list[Sample] = []
    trees: list[Sample] = []
    for t in range(batch // per_tree):
        n = prefix + per_tree * branch
        ids = rng.integers(0, vocab, n)
        mask = np.r_[np.zeros(prefix), np.ones(per_tree * branch)]
        blp = -rng.uniform(0.5, 3.0, n)
        advantage = float(rng.normal())  # rollout-level: the same on every path of the tree
        parents = np.arange(-1, n - 1)
        for k in range(per_tree):
            start = prefix + k * branch
            parents[start] = prefix - 1  # each branch hangs off the last prompt token
            idx = np.r_[np.arange(prefix), np.arange(start, start + branch)]
            paths.append(
                _sample(f"r{t}/{k}", ids[idx], mask[idx], blp[idx], advantage, 1.0 / per_tree)
            )
        trees.append(_sample(f"r{t}", ids, mask, blp, advantage, 1.0, parents))
    return paths, trees


class Trainer:
    """One model + AdamW on one fixed batch; ``step`` returns (seconds, loss)."""

    def __init__(self, model: Qwen2ForCausalLM, batch: dict[str, torch.Tensor]) -> None:
        self.model, self.batch = model, batch
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.config = LossConfig()
        self.cuda = batch["input_ids"].is_cuda

    def step(self) -> tuple[float, float]:
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        logp = batch_token_logprobs(self.model, self.batch)  # (B, T)
        loss, _ = batch_loss(logp, self.batch, self.config)
        loss.backward()
        self.optimizer.step()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, loss.item()


def time_interleaved(
    trainers: list[Trainer], warmup: int, steps: int
) -> tuple[list[float], list[float]]:
    """Median seconds per step of each trainer, and each one's first (pre-update) loss. Steps
    alternate between trainers so load from other processes hits every mode alike."""
    times: list[list[float]] = [[] for _ in trainers]
    first: list[float] = [float("nan")] * len(trainers)
    for i in range(warmup + steps):
        for k, trainer in enumerate(trainers):
            seconds, loss = trainer.step()
            if i == 0:
                first[k] = loss
            if i >= warmup:
                times[k].append(seconds)
    return [float(np.median(t)) for t in times], first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (under 30 s on CPU)")
    parser.add_argument("--batch", type=int, default=16, help="leaf paths per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per path")
    parser.add_argument("--prefix", type=int, default=64, help="shared prompt tokens per tree")
    parser.add_argument("--per-tree", type=int, default=4, help="paths sharing one prefix")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.batch % args.per_tree or not 0 < args.prefix < args.seq:
        parser.error("need batch divisible by --per-tree and 0 < prefix < seq")
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or (3 if args.quick else 30)
    warmup = 1 if args.quick else 3

    paths, trees = make_data(args.batch, args.seq, args.prefix, args.per_tree, args.vocab)
    start = time.perf_counter()
    path_batch = collate(paths)
    path_collate_s = time.perf_counter() - start
    start = time.perf_counter()
    tree_batch = collate(trees)
    tree_collate_s = time.perf_counter() - start
    path_batch = {k: v.to(args.device) for k, v in path_batch.items()}
    tree_batch = {k: v.to(args.device) for k, v in tree_batch.items()}

    model = build_model(args.vocab, args.hidden, args.layers, args.attn, args.device)
    trainers = [Trainer(copy.deepcopy(model), b) for b in (path_batch, tree_batch)]
    (path_s, tree_s), (path_loss, tree_loss) = time_interleaved(trainers, warmup, steps)

    path_tokens = args.batch * args.seq
    figures: dict[str, Any] = {
        "bench": "train_step",
        "quick": args.quick,
        "device": args.device,
        "attn": args.attn,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
        "paths": args.batch,
        "tokens_per_path": args.seq,
        "prefix": args.prefix,
        "paths_per_tree": args.per_tree,
        "path_tokens": path_tokens,
        "tree_unique_tokens": int(tree_batch["attention_mask"].sum()),
        "path_batch_shape": list(path_batch["input_ids"].shape),
        "tree_batch_shape": list(tree_batch["input_ids"].shape),
        "steps": steps,
        "path_step_ms": round(path_s * 1e3, 2),
        "tree_step_ms": round(tree_s * 1e3, 2),
        "path_tokens_per_s": round(path_tokens / path_s),
        "tree_tokens_per_s": round(path_tokens / tree_s),
        "tree_speedup": round(path_s / tree_s, 3),
        "path_collate_ms": round(path_collate_s * 1e3, 2),
        "tree_collate_ms": round(tree_collate_s * 1e3, 2),
        "first_loss_path": path_loss,
        "first_loss_tree": tree_loss,
        "loss_rel_diff": abs(path_loss - tree_loss) / max(abs(path_loss), 1e-12),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
