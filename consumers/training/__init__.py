"""rollstream.consumers.training: the trainer, PPO loss, tree packing, batching, the sample
dataset and checkpoints (install the ``train`` extra)."""
