"""`lmforge serve`'s process: the API keys it accepts, the socket it binds, the server it builds over a
run's model (engine, adapters, quantized layers, the app) and the loop that serves until interrupted.

FastAPI and uvicorn are the optional extra `lmforge[serve]`, imported only here and in app.py.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from lmforge.errors import LmforgeError
from lmforge.serve.engine import Engine
from lmforge.utils.bounds import PORT, THREADS, whole

ENV_KEY = "LMFORGE_API_KEY"
ENV_ADMIN_KEY = "LMFORGE_ADMIN_KEY"
MAX_BATCH = whole(1, 1024)  # rows of the engine's KV cache, allocated at start (the CLI's range too)
PREFIX_MB = whole(0, 1_048_576)  # the prefix cache's budget in MiB (the CLI's range too)
PREFIX_CACHE_MB = 256  # the default budget (cli/args.py's too); see `serve`
MAX_ADAPTERS = whole(1, 1024)  # adapters held at once (serve/adapters.py)
MAX_LORA_RANK = whole(1, 4096)


def _require_extra():
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise LmforgeError(f"lmforge serve needs FastAPI and uvicorn ({e.name} is missing): "
                           "pip install 'lmforge[serve]'") from None
    return uvicorn


def resolve_api_keys(api_keys: Sequence[str], no_auth: bool,
                     env: dict[str, str] | None = None) -> list[str] | None:
    """The keys the server accepts (--api-key, else $LMFORGE_API_KEY), or None with --no-auth. Serving
    without a key is refused unless --no-auth says so."""
    env = os.environ if env is None else env
    keys = list(api_keys)
    if no_auth:
        if keys:
            raise LmforgeError("give --api-key or --no-auth, not both")
        return None
    if not keys and env.get(ENV_KEY):
        keys = [env[ENV_KEY]]
    if not keys:
        raise LmforgeError(f"refusing to serve without an API key: give --api-key KEY (repeatable) or set "
                           f"{ENV_KEY}, or pass --no-auth to let anyone who reaches the port use the model")
    for k in keys:
        if not k.strip() or k != k.strip() or not k.isprintable():
            raise LmforgeError("an API key must be printable text without surrounding spaces")
    return keys


class Server:
    """uvicorn serving `app` on an already bound socket: in this thread (`run`) or another (`start`)."""

    def __init__(self, app, sock: socket.socket, engine: Engine, model_name: str,
                 log_level: str = "warning") -> None:
        import uvicorn

        self.app, self.sock, self.engine, self.model_name = app, sock, engine, model_name
        config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        host, port = sock.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        self.url = f"http://{host}:{port}/v1"

    def run(self) -> None:
        """Serve until interrupted (Ctrl-C / SIGTERM), then stop the engine."""
        try:
            self._server.run(sockets=[self.sock])
        finally:
            self.engine.close()
            self.sock.close()

    def start(self, timeout: float = 30.0) -> Server:
        """Serve from a background thread; returns once the server accepts connections."""
        self._thread = threading.Thread(target=self.run, name="lmforge-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop a server started with `start`."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one), or a clear error when that is impossible."""
    PORT.check(port, "--port")  # getaddrinfo would take 70000 modulo 2**16 and serve on port 4464
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise LmforgeError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        hint = "; is another server using it? pick another --port" if e.errno == errno.EADDRINUSE else ""
        raise LmforgeError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    return sock


def build_server(path: str | Path, host: str = "127.0.0.1", port: int = 8000, *,
                 api_keys: Sequence[str] | None, model_name: str | None = None, max_batch_size: int = 8,
                 weights: str = "model", overrides: Sequence[str] = (), threads: int | None = None,
                 max_queue: int = 1024, log_level: str = "warning",
                 prefix_cache_mb: int = PREFIX_CACHE_MB, loras: Sequence[tuple[str, str]] = (),
                 admin_key: str | None = None, adapter_root: str | Path | None = None,
                 max_adapters: int = 8, max_lora_rank: int = 64, quantized: str | None = None,
                 quant_path: str = "auto", memory_budget_mb: float | None = None, say=print) -> Server:
    """Load a run (run dir, checkpoint dir or Hugging Face dir), bind host:port and build the app;
    the engine thread is running, the server not yet (call `run()` or `start()`).

    api_keys: accepted keys, None for no authentication (see `resolve_api_keys`). threads: torch's CPU
    threads (process-wide; None leaves them as they are). prefix_cache_mb: the prefix cache's budget
    in MiB (0: off). loras: (name, path) adapters served beside the base; admin_key and adapter_root:
    runtime loads from under that dir (`resolve_admin_key`). quantized: int8 / int4 / auto
    serves weight-only quantized layers on the fastest CPU path whose weights fit memory_budget_mb
    (serve/quantized.py); quant_path names the path instead of probing."""
    _require_extra()
    from lmforge.eval.open_run import chat_template_of, load_run
    from lmforge.serve.app import create_app

    MAX_BATCH.check(max_batch_size, "--max-batch-size")  # the KV cache holds this many rows
    MAX_ADAPTERS.check(max_adapters, "--max-adapters")
    MAX_LORA_RANK.check(max_lora_rank, "--max-lora-rank")
    if (admin_key is None) != (adapter_root is None):
        raise LmforgeError("runtime adapter loads need both an admin key and --adapter-root")
    if len(loras) > max_adapters:
        raise LmforgeError(f"{len(loras)} --lora adapters exceed --max-adapters {max_adapters}")
    if threads is not None:
        THREADS.check(threads, "--threads")
    PREFIX_MB.check(prefix_cache_mb, "--prefix-cache-mb")
    from lmforge.serve.quantized import check_flags, prepare

    check_flags(quantized, quant_path, memory_budget_mb)
    sock = bind(host, port)  # before loading: a busy port fails fast
    try:
        run = load_run(path, list(overrides), weights)
        if threads is not None:
            torch.set_num_threads(threads)
        if quantized is not None:  # after the threads: the probe times the kernels as they will run
            budget = None if memory_budget_mb is None else int(memory_budget_mb * 2**20)
            run.model, _ = prepare(run.model, quantized, quant_path, budget, max_batch_size, say=say)
        name = model_name or run.cfg.run.name or Path(path).name
        adapters = None
        if loras or admin_key is not None:
            from lmforge.serve.adapters import AdapterSet

            adapters = AdapterSet(run.model, name, max_adapters=max_adapters, max_rank=max_lora_rank,
                                  root=adapter_root)
            for lora_name, lora_path in loras:  # the operator's own paths: not confined to the root
                try:
                    adapters.load(lora_name, lora_path, confined=False)
                except LmforgeError as e:
                    raise LmforgeError(f"--lora {lora_name}={lora_path}: {e}") from None
        engine = Engine(run.model, run.tokenizer.decode, max_batch_size=max_batch_size, max_queue=max_queue,
                        prefix_cache_bytes=prefix_cache_mb << 20, adapters=adapters)
        app = create_app(engine, run.tokenizer, chat_template_of(run), model_name=name, api_keys=api_keys,
                         admin_key=admin_key)
    except BaseException:
        sock.close()
        raise
    engine.start()
    return Server(app, sock, engine, name, log_level)


def start_server(path: str | Path, *, api_keys: Sequence[str] | None, host: str = "127.0.0.1", port: int = 0,
                 **kw) -> Server:
    """`build_server` serving from a background thread (tests, notebooks); stop it with `stop()` or `with`."""
    return build_server(path, host, port, api_keys=api_keys, **kw).start()


def serve(path: str | Path, host: str = "127.0.0.1", port: int = 8000, api_keys: Sequence[str] = (),
          no_auth: bool = False, model_name: str | None = None, max_batch_size: int = 8,
          weights: str = "model", overrides: Sequence[str] = (), threads: int | None = None,
          prefix_cache_mb: int = PREFIX_CACHE_MB, loras: Sequence[str] = (), admin_key: str | None = None,
          adapter_root: str | None = None, max_adapters: int = 8, max_lora_rank: int = 64,
          quantized: str | None = None, quant_path: str = "auto", memory_budget_mb: float | None = None,
          say=print) -> None:
    """`lmforge serve`: serve a run on host:port until interrupted.

    threads: torch's CPU threads; default one core fewer than the machine has (at most 8), leaving one
    to the HTTP loop (tokenizing, streaming). A decode step is a handful of small matmuls, which lose
    more to thread synchronisation than they gain on a busy machine: the demo model decoded 16
    sequences at 688 tokens/s with 1 thread and 62 with 2 on 2 shared cores (load 8).

    prefix_cache_mb: the prefix cache (serve/prefix_cache.py) is on by default, as in vLLM and SGLang:
    requests sharing a 1k-token system prompt got their first token 20x sooner (bench/serve_prefix.py),
    a miss costs about what it did without it, and the memory is bounded and taken only as prompts
    fill it. 0 turns it off: each prompt is prefilled in one forward, as before it existed (replies
    equal bit for bit to a build without it)."""
    from lmforge.serve.adapters import parse_lora_specs

    keys = resolve_api_keys(api_keys, no_auth)
    admin = resolve_admin_key(admin_key, adapter_root, keys)
    threads = threads or max(1, min(8, (os.cpu_count() or 2) - 1))
    server = build_server(path, host, port, api_keys=keys, model_name=model_name,
                          max_batch_size=max_batch_size, weights=weights, overrides=overrides,
                          threads=threads, prefix_cache_mb=prefix_cache_mb, loras=parse_lora_specs(loras),
                          admin_key=admin, adapter_root=adapter_root, max_adapters=max_adapters,
                          max_lora_rank=max_lora_rank, quantized=quantized, quant_path=quant_path,
                          memory_budget_mb=memory_budget_mb, say=say)
    cfg = server.engine.model.cfg
    from lmforge.models.quant import QuantLinear

    model = server.engine.model  # a quantized layer holds its weights as buffers: count them too
    n_params = sum(p.numel() for p in model.parameters()) + sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantLinear))
    n_threads = torch.get_num_threads()
    say(f"lmforge serve: {server.model_name} ({n_params:,} parameters, context {cfg.max_seq_len} tokens) at "
        f"{server.url} (max batch {max_batch_size}, {n_threads} thread{'s' * (n_threads != 1)}, "
        f"prefix cache {f'{prefix_cache_mb} MiB' if server.engine.prefix_cache is not None else 'off'}); "
        + ("API key required" if keys is not None else "NO authentication"))
    adapters = server.engine.adapters
    if adapters is not None:
        served = ", ".join(adapters.names()) or "(none yet)"
        runtime = f"; runtime loads from {adapter_root} with the admin key" if admin is not None else ""
        say(f"lmforge serve: adapters {served} (max {max_adapters}, rank <= {max_lora_rank}){runtime}")
    if keys is None and not _is_loopback(host):
        say(f"lmforge serve: warning: --no-auth on {host}: anyone who can reach this port can use the model")
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised Ctrl-C: the normal way out
        pass
    say("lmforge serve: stopped")


def resolve_admin_key(admin_key: str | None, adapter_root: str | Path | None, api_keys: Sequence[str] | None,
                      env: dict[str, str] | None = None) -> str | None:
    """The key of the adapter admin routes (--admin-key, else $LMFORGE_ADMIN_KEY), which runtime loads
    (--adapter-root) need; None when there are none. It must differ from every API key."""
    env = os.environ if env is None else env
    if adapter_root is None:
        if admin_key is not None:
            raise LmforgeError("--admin-key enables loading adapters at run time, which reads them only "
                               "from --adapter-root DIR: give that too")
        return None
    key = admin_key if admin_key is not None else env.get(ENV_ADMIN_KEY)
    if not key:
        raise LmforgeError(f"--adapter-root needs an admin key for /v1/load_lora_adapter: give --admin-key "
                           f"KEY or set {ENV_ADMIN_KEY}")
    if key != key.strip() or not key.isprintable():
        raise LmforgeError("the admin key must be printable text without surrounding spaces")
    if key in (api_keys or ()):
        raise LmforgeError("the admin key must differ from every API key (a client would be an admin)")
    return key


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
