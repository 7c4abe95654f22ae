"""dspark.runtime.serving: the engine service (one decode loop in a background thread behind a thread-safe
submit / stream / cancel API, usable without HTTP) and the OpenAI-compatible HTTP app on top of it.

    from dspark.runtime.serving.service import EngineService
    with EngineService(runtime) as service:
        handle = service.submit("def parse_args(", max_new_tokens=32)
        for tokens in handle.stream(): ...

The HTTP side (`app.py`: starlette) is imported only by `dspark serve`, so the service needs no web stack.
"""
