"""rollstream.producers.proxy: the recording LLM proxy (install the ``proxy`` extra).

One request, one pipeline: parse (wire format) -> normalize and render (chat) -> budget ->
generate (backend pool) -> record (sdk) -> answer (wire format). ``service`` runs it and knows no
HTTP framework; ``app`` is the ASGI app over the service."""
