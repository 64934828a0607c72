"""rollstream.inference: the reference inference server and the tiny local model (a backend
the proxy and the trainer use, not a producer). vLLM is the GPU backend behind the same API.

    settings.py     ModelServerSettings (light: no torch)
    tinymodel.py    tokenizer, model, weights, the batched sampling loop
    engine.py       the model's worker thread and the batching scheduler
    wire.py         vLLM's request checks and response bodies
    server.py       the ASGI app (``rollstream serve-model``)
    errors.py       InferenceError and its tree
"""
