"""rollstream.infra"""
