"""rollstream.streams"""
