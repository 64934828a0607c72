"""rollstream.inference: the reference inference server and the tiny local model (a backend
the proxy and the trainer use, not a producer). vLLM is the GPU backend behind the same API."""
