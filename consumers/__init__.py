"""rollstream.consumers"""
