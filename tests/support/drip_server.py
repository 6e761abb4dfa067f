"""A token endpoint that drips its answer one byte at a time, for the exchange's deadline:
each byte comes well within the read timeout, the whole answer never within the deadline."""

from __future__ import annotations

import http.server
import json
import select
import socket
import threading
import time
from typing import Any

DRIPPED_TOKEN = "tok-0b6f2c9e4d1a"


class Dripping(http.server.BaseHTTPRequestHandler):
    """Answers the token request one byte at a time (``server.dripped``): its status line
    and headers, then its body at once; or its headers at once, then its body."""

    server: DripServer

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.dumps({"access_token": DRIPPED_TOKEN, "expires_in": 7200}).encode()
        head = (
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        # dripped headers, then the body at once: a client still connected when the headers
        # are done (past its deadline) gets the whole answer, and the server counts it finished
        before, dripped, after = (
            (head, body, b"") if self.server.dripped == "body" else (b"", head, body)
        )
        with self.server.lock:
            self.server.in_flight += 1
            self.server.most_in_flight = max(self.server.most_in_flight, self.server.in_flight)
        try:
            self.wfile.write(before)
            for byte in dripped:
                self._wait(self.server.drip)
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            self.wfile.write(after)
            self.wfile.flush()
            self.server.finished += 1
        except OSError:  # the client hung up: its deadline passed
            self.server.hung_up += 1
        finally:
            with self.server.lock:
                self.server.in_flight -= 1

    def _wait(self, seconds: float) -> None:
        """Sleep, noticing within 10 ms a client that hung up (not only at the next write)."""
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            readable, _, _ = select.select([self.connection], [], [], 0.01)
            if readable and not self.connection.recv(1, socket.MSG_PEEK):
                raise ConnectionResetError("the client hung up")

    def log_message(self, format: str, *args: Any) -> None:
        pass


class DripServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, drip: float, dripped: str) -> None:
        super().__init__(("127.0.0.1", 0), Dripping)
        self.drip = drip
        self.dripped = dripped
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = self.finished = self.hung_up = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


DRIP = 0.1  # seconds between two bytes of a dripping answer: 50-80 bytes take 5-8 s
# connect and read timeouts against it: each byte comes well within the read timeout, the
# whole answer never within the exchange's deadline (their sum, 0.75 s)
DRIP_TIMEOUT = (0.25, 0.5)
SHUTDOWN_POLL = 0.05  # seconds a dripping server takes to notice shutdown() (0.5 by default)
