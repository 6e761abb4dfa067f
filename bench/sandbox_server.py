"""The emulator in a process of its own, so its request handling never shares a GIL with
the callers being measured.

Run as ``python bench/sandbox_server.py [werkzeug|tornado]`` with MERCHANT_API_KEY and
MERCHANT_API_SECRET_FILE set. It binds a free loopback port, prints its base URL on one
line and serves until it is sent SIGTERM, or after BENCH_MAX_SECONDS (default 3600) if
nobody stops it. Lifetime, revoke-on-issue and the rest are set later through
``POST /_sandbox/config``.

- ``werkzeug`` (default): ``SandboxServer``, the project's own server. Werkzeug's
  development server answers every request with ``Connection: close``, so each call
  opens a new TCP connection and the server starts a thread for it.
- ``tornado``: the same ``SandboxApp`` behind Tornado's HTTP/1.1 server (keep-alive), via
  ``tornado.wsgi.WSGIContainer`` on the event-loop thread. Only for the hot path's
  keep-alive variant, where a per-call connect would hide the client's own cost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

from merchant_tasks.sandbox.emulator import SandboxApp, SandboxConfig, SandboxServer


def serve_werkzeug(app: SandboxApp, deadline: float) -> None:
    server = SandboxServer(app, "127.0.0.1", 0).start()
    sys.stdout.write(server.url + "\n")
    sys.stdout.flush()
    while time.monotonic() < deadline:  # the server runs in its own thread
        time.sleep(0.5)


async def serve_tornado(app: SandboxApp, deadline: float) -> None:
    from tornado.httpserver import HTTPServer
    from tornado.netutil import bind_sockets
    from tornado.wsgi import WSGIContainer

    logging.getLogger("tornado.access").setLevel(logging.ERROR)  # 401s are expected
    sockets = bind_sockets(0, "127.0.0.1")
    server = HTTPServer(WSGIContainer(app))
    server.add_sockets(sockets)
    port = sockets[0].getsockname()[1]
    sys.stdout.write(f"http://127.0.0.1:{port}\n")
    sys.stdout.flush()
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "werkzeug"
    secret = Path(os.environ["MERCHANT_API_SECRET_FILE"]).read_text(encoding="utf-8").strip()
    app = SandboxApp(SandboxConfig(api_key=os.environ["MERCHANT_API_KEY"], secret=secret))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    deadline = time.monotonic() + float(os.environ.get("BENCH_MAX_SECONDS", "3600"))
    if kind == "werkzeug":
        serve_werkzeug(app, deadline)
    elif kind == "tornado":
        asyncio.run(serve_tornado(app, deadline))
    else:
        raise SystemExit(f"unknown server {kind!r}: werkzeug or tornado")


if __name__ == "__main__":
    main()
