"""The image's HEALTHCHECK: GET /health of `lmforge serve` or `lmforge jobs` when the container runs one,
else pass.

One image runs every verb; a training container has no server to probe and must not turn unhealthy for
that, so the command line of the container's first process decides. Standard library only (it runs
every 30 s in the container: no lmforge or torch import)."""

from __future__ import annotations

import sys
import urllib.request

# The servers' --port defaults (lmforge.cli.verbs.serve; a test keeps them equal).
DEFAULT_PORTS = {"serve": 8000, "jobs": 8080}


def target(argv: list[str]) -> str | None:
    """The health URL of the `lmforge serve` or `lmforge jobs` started as `argv`, or None when argv is
    neither (another verb, or `lmforge jobs token ...`, which is not a server)."""
    verb = next((i for i, a in enumerate(argv) if a.rsplit("/", 1)[-1] == "lmforge"), None)
    if verb is None or verb + 1 >= len(argv) or argv[verb + 1] not in DEFAULT_PORTS:
        return None
    rest = argv[verb + 2:]
    if argv[verb + 1] == "jobs" and "token" in rest:
        return None
    host, port = "127.0.0.1", DEFAULT_PORTS[argv[verb + 1]]
    for i, a in enumerate(rest):
        for flag in ("--host", "--port"):
            value = a[len(flag) + 1:] if a.startswith(flag + "=") else (
                rest[i + 1] if a == flag and i + 1 < len(rest) else None)
            if value is None:
                continue
            if flag == "--port":
                port = int(value)
            elif value not in ("0.0.0.0", "::", ""):  # a wildcard is reached on loopback
                host = value
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/health"


def main() -> int:
    try:
        with open("/proc/1/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return 0  # no /proc (not Linux): nothing to say
    url = target(argv)
    if url is None:
        return 0
    try:
        with urllib.request.urlopen(url, timeout=4) as r:
            return 0 if r.status == 200 else 1
    except OSError as e:
        print(f"lmforge healthcheck: {url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
