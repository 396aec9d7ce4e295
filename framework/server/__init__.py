"""The OpenAI-compatible server (``fw serve``): DESIGN §3 and §6.

Modules, one job each:

* ``messages`` / ``engine_process`` / ``engine_client``: the engine in its own process and the
  API process's :class:`~framework.server.engine_client.AsyncEngineClient` talking to it over ZMQ.
* ``protocol``: request and response bodies (msgspec Structs mirroring OpenAI's schema).
* ``errors``: OpenAI's error envelope; ``state``: config, admission, disconnect and SSE helpers.
* ``generation``: request -> SamplingParams, fan-out over ``n`` and prompts, text per choice.
* ``serving_chat`` / ``serving_completion``: the two generation endpoints.
* ``app``: ``create_app(engine_client, config)``; ``metrics``: Prometheus; ``launcher``: uvicorn.
"""
