"""rollstream.consumers.analytics: the analytics server (settings, protocol, read-only gate) and
its client, canned reports, the report CLI, replay, and ``rollstream sink`` (service.py: the
sink loop with the analytics server beside it, in the process that owns the store)."""
