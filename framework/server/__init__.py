"""The OpenAI-compatible server (``fw serve``): DESIGN §3 and §6.

Modules, one job each:

* ``engine_client``: the API process's :class:`~framework.server.engine_client.AsyncEngineClient`,
  talking over ZMQ to the engine in its own process (``framework.engine.engine_process``, with
  the messages of ``framework.engine.messages``).
* ``protocol``: request and response bodies (msgspec Structs mirroring OpenAI's schema).
* ``errors``: OpenAI's error envelope; ``state``: config, admission, disconnect and SSE helpers.
* ``generation``: request -> SamplingParams, fan-out over ``n`` and prompts, text per choice.
* ``serving_chat`` / ``serving_completion``: the two generation endpoints.
* ``app``: ``create_app(engine_client, config)``; ``metrics``: Prometheus; ``launcher``: uvicorn.
"""
