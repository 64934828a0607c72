"""rollstream.consumers.training: the trainer (settings apart, in settings.py), PPO loss, tree
packing, batching, the sample dataset and checkpoints (install the ``train`` extra)."""
