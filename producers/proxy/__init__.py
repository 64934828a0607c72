"""rollstream.producers.proxy: the recording LLM proxy (install the ``proxy`` extra).

One request, one pipeline, each step a function the service calls once (service.py):
parse (openai_wire) -> normalize and render (chat, messages, chat_template) -> budget ->
generate (pool, backends, http1) -> read the reply (chat) -> record (the SDK's RolloutHandle) ->
answer (openai_wire).

    settings.py      ProxySettings                  app.py         the ASGI app, ``run``
    service.py       Proxy: the pipeline, routes    rollout_api.py tokens, open rollouts, API
    openai_wire.py   requests, answers, errors      openapi.py     GET /openapi.json
    chat.py          render a turn, read a reply    messages.py    OpenAI messages normalized
    chat_template.py the model's template, tokens   pool.py        sticky routing, failover
    backends.py      a backend's completion API     http1.py       the lean HTTP/1.1 client
    policy_watch.py  policy.versions -> weight updates (dead letters for bad records)
    job_tokens.py    job evaluator tokens           jobs_api.py    /v1/jobs routes

``service`` knows no HTTP framework; only ``app`` imports Starlette and uvicorn. Errors:
rollstream.producers.errors."""
