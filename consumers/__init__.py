"""rollstream.consumers: what reads the log and keeps or learns from it, in three rooms.

    store/          the ClickHouse sink loop, its batches, workers and writer, the row and column
                    mappers, the store client, the rollout queries, the migrations and their DDL
    analytics/      the analytics server and its client, canned reports, the report CLI, replay,
                    and ``rollstream sink`` (service.py: the sink loop with the server beside it)
    training/       the trainer, PPO loss, tree packing, batching, the sample dataset, checkpoints

analytics reads the store; the store knows no analytics; training is independent of both.
Every error derives from ``errors.ConsumerError`` (the tree is drawn in errors.py).
"""
