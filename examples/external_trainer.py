"""An external trainer fed by rollstream: a plain torch loop over ``SamplesDataset``.

Any trainer that takes a torch IterableDataset (verl, TRL, your own loop) can read the samples
topic the same way. This one trains a causal LM with rollstream's PPO-clip loss, and makes it
exactly once the way rollstream's own trainer does: the dataset commits nothing by itself
(commit="manual"); after each checkpoint the loop saves ``dataset.position()`` next to the
weights and then commits it to the consumer group; a restart passes the saved position back
as ``start_offsets``.

    ROLLSTREAM_KAFKA_BOOTSTRAP=127.0.0.1:9092 ROLLSTREAM_NAMESPACE=demo \\
        python examples/external_trainer.py --model .rollstream/models/tiny --out /tmp/ext

Prints one JSON line at the end: steps, samples, tokens, last loss.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from rollstream.consumers.training.dataset import SamplesDataset
from rollstream.consumers.training.ppo import LossConfig, batch_loss
from rollstream.consumers.training.treepack import batch_token_logprobs
from rollstream.schemas import CommonSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a transformers model dir")
    parser.add_argument("--out", type=Path, required=True, help="where checkpoints go")
    parser.add_argument("--group", default="external-trainer-v1", help="consumer group")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="padded tokens/batch")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--idle-timeout", type=float, default=None, help="stop when idle (s)")
    parser.add_argument("--checkpoint-every", type=int, default=2, help="steps")
    args = parser.parse_args(argv)

    settings = CommonSettings()  # ROLLSTREAM_KAFKA_BOOTSTRAP, ROLLSTREAM_NAMESPACE, ...
    position_file = args.out / "position.json"
    start = (
        {int(p): o for p, o in json.loads(position_file.read_text()).items()}
        if (position_file.exists())
        else None
    )
    model = AutoModelForCausalLM.from_pretrained(args.out / "model" if start else args.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataset = SamplesDataset(
        settings,
        group_id=args.group,
        collate=True,  # dicts of (B, T) tensors, B * T <= batch_tokens
        batch_tokens=args.batch_tokens,
        commit="manual",
        start_offsets=start,
        idle_timeout=args.idle_timeout,
    )

    def checkpoint() -> None:
        model.save_pretrained(args.out / "model")  # a real trainer writes this atomically
        position_file.write_text(json.dumps(dataset.position()))
        dataset.commit()  # after the checkpoint: the group's offsets are for monitoring

    steps = samples = tokens = 0
    loss = torch.tensor(0.0)
    model.train()
    for batch in DataLoader(dataset, batch_size=None):  # the dataset batches by tokens
        logp = batch_token_logprobs(model, batch)  # (B, T), aligned with old_logprobs
        loss, _stats = batch_loss(logp, batch, LossConfig(clip_low=0.2, clip_high=0.28))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
        samples += int(batch["input_ids"].shape[0])
        tokens += int(batch["attention_mask"].sum())
        if steps % args.checkpoint_every == 0:
            checkpoint()
        if args.max_steps is not None and steps >= args.max_steps:
            break
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint()
    summary = {"steps": steps, "samples": samples, "tokens": tokens, "loss": float(loss)}
    print(json.dumps(summary), file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
