"""rollstream.producers"""
