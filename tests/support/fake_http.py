"""A fake requests transport for the unit tests of the exchange and the client: canned
replies in turn, and a record of every request sent."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import requests
from requests.adapters import BaseAdapter
from requests.structures import CaseInsensitiveDict

Reply = requests.Response | Exception | Callable[[requests.PreparedRequest], requests.Response]


def response(
    status: int = 200, body: Any = None, headers: Mapping[str, str] | None = None
) -> requests.Response:
    """A response as the transport would build it; ``body`` bytes or str are sent as they are."""
    built = requests.Response()
    built.status_code = status
    if body is None:
        built._content = b""
    elif isinstance(body, bytes):
        built._content = body
    elif isinstance(body, str):
        built._content = body.encode()
    else:
        built._content = json.dumps(body).encode()
    built.headers = CaseInsensitiveDict(headers or {})
    built.encoding = "utf-8"
    return built


@dataclass
class Sent:
    method: str
    url: str
    headers: CaseInsensitiveDict[str]
    body: bytes
    timeout: object

    @property
    def bearer(self) -> str:
        return self.headers["authorization"].removeprefix("Bearer ")


class FakeTransport(BaseAdapter):
    """Answers each request with the next reply (the last one repeats) and records it."""

    def __init__(self, *replies: Reply) -> None:
        super().__init__()
        self.replies: list[Reply] = list(replies) or [response(200, {"ok": True})]
        self.sent: list[Sent] = []

    def reply(self, *replies: Reply) -> None:
        self.replies = list(replies)

    def send(  # type: ignore[override]
        self, request: requests.PreparedRequest, timeout: object = None, **_: object
    ) -> requests.Response:
        body = request.body.encode() if isinstance(request.body, str) else request.body or b""
        headers = CaseInsensitiveDict(dict(request.headers))
        self.sent.append(Sent(request.method or "", request.url or "", headers, body, timeout))
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        if isinstance(reply, Exception):
            raise reply
        built = reply(request) if callable(reply) else reply
        built.request = request
        built.url = request.url or ""
        return built

    def close(self) -> None:
        pass


def session_with(transport: FakeTransport) -> requests.Session:
    """A session whose every request goes to ``transport``."""
    session = requests.Session()
    session.mount("https://", transport)
    session.mount("http://", transport)
    return session
