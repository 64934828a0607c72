"""rollstream.producers.sdk: the harness SDK (Recorder, delivery, spool, transport, context trie,
ids). It needs only the base install (confluent-kafka, fastavro, numpy, pydantic-settings)."""
