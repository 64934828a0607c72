"""rollstream.streams.core"""
