"""rollstream.consumers.store: the ClickHouse sink (loop, settings, batches, workers, writer,
dead letters, verification), the row and column mappers and the tables' columns, the store
client, the rollout queries, and the migrations with their DDL (ddl/*.sql)."""
