"""rollstream.consumers.store: the ClickHouse sink (loop, batches, workers, verification), the row
and column mappers, the store client and the migrations with their DDL (ddl/*.sql)."""
