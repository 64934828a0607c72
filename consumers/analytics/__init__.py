"""rollstream.consumers.analytics: the analytics server and client, canned reports, the report
CLI and replay."""
