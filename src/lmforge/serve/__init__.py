"""`lmforge serve RUN`: an OpenAI-compatible HTTP server (completions, chat completions, streaming) over
a run's model, with continuous batching (engine.py), OpenAI's schemas and errors (protocol.py, app.py)
and API-key authentication.

FastAPI and uvicorn are the optional extra `lmforge[serve]`, imported only in server.py and app.py.
This package's names are re-exported from server.py (the process: keys, socket, build, run) and
engine.py.

    from lmforge.serve import start_server
    with start_server("runs/demo", api_keys=["secret"], port=0) as server:   # a thread, a free port
        print(server.url)                                                     # http://127.0.0.1:PORT/v1
"""

from lmforge.serve.engine import Engine, EngineBusy, Event, SamplingParams
from lmforge.serve.server import (
    ENV_ADMIN_KEY,
    ENV_KEY,
    MAX_ADAPTERS,
    MAX_BATCH,
    MAX_LORA_RANK,
    PREFIX_CACHE_MB,
    PREFIX_MB,
    Server,
    bind,
    build_server,
    resolve_admin_key,
    resolve_api_keys,
    serve,
    start_server,
)

__all__ = ["ENV_ADMIN_KEY", "ENV_KEY", "MAX_ADAPTERS", "MAX_BATCH", "MAX_LORA_RANK", "PREFIX_CACHE_MB",
           "PREFIX_MB", "Engine", "EngineBusy", "Event", "SamplingParams", "Server", "bind", "build_server",
           "resolve_admin_key", "resolve_api_keys", "serve", "start_server"]
