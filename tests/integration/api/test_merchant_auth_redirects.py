"""``MerchantAuth`` on a user's client that follows redirects: an API path the emulator
redirects to a page outside the API (a login page answering 401). requests does not carry
the token there; with httpx (which keeps it for the same host), the page's 401 is not
judged as the token's: nothing is renewed."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import requests

from merchant_tasks.accounts import FleetClient, client_for, close_client
from merchant_tasks.api.auth import MerchantAuth
from merchant_tasks.sandbox.emulator import SandboxApp, SandboxConfig
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.settings import Settings
from support.routes import PING, exchanges

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

pytestmark = pytest.mark.integration

MOVED = "/open-api/v1/moved"
LOGIN = "/login"


class RedirectingSandbox(SandboxApp):
    """The emulator, but ``MOVED`` redirects to ``LOGIN``, which answers 401 and notes the
    Authorization header it was sent."""

    def __init__(self, config: SandboxConfig) -> None:
        super().__init__(config)
        self.login_headers: list[str | None] = []
        self._seen = threading.Lock()

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == MOVED:
            start_response("302 Found", [("Location", LOGIN), ("Content-Length", "0")])
            return [b""]
        if path == LOGIN:
            with self._seen:
                self.login_headers.append(environ.get("HTTP_AUTHORIZATION"))
            start_response("401 Unauthorized", [("Content-Length", "0")])
            return [b""]
        return super().__call__(environ, start_response)


@pytest.fixture
def merchant_sandbox_app(merchant_sandbox_config: SandboxConfig) -> RedirectingSandbox:
    return RedirectingSandbox(merchant_sandbox_config)


@pytest.fixture
def blocking(merchant_settings: Settings) -> Iterator[FleetClient]:
    client = client_for(merchant_settings)
    yield client
    close_client(client)


def login_headers(sandbox: MerchantSandbox) -> list[Any]:
    app: Any = sandbox.app
    return list(app.login_headers)


def test_requests_follows_a_redirect_without_the_token_and_renews_nothing(
    blocking: FleetClient, merchant_sandbox: MerchantSandbox
) -> None:
    with requests.Session() as session:
        session.auth = MerchantAuth(blocking)
        assert session.get(merchant_sandbox.url + PING, timeout=10).json() == {"ok": True}
        answer = session.get(merchant_sandbox.url + MOVED, timeout=10)
    assert answer.status_code == 401
    assert [r.status_code for r in answer.history] == [302]
    assert login_headers(merchant_sandbox) == [None]  # the token stayed with the API
    assert exchanges(merchant_sandbox) == 1  # the page's 401 renewed nothing


def test_httpx_following_a_redirect_gets_the_pages_401_and_renews_nothing(
    blocking: FleetClient, merchant_sandbox: MerchantSandbox
) -> None:
    auth = MerchantAuth(blocking)
    with httpx.Client(base_url=merchant_sandbox.url, auth=auth, follow_redirects=True) as http:
        assert http.get(PING).json() == {"ok": True}
        answer = http.get(MOVED)
    assert answer.status_code == 401
    assert [r.status_code for r in answer.history] == [302]
    assert len(login_headers(merchant_sandbox)) == 1  # httpx keeps it for the same host
    assert exchanges(merchant_sandbox) == 1  # the page's 401 renewed nothing
    assert merchant_sandbox.app.counters()["calls"].get("unauthorized", 0) == 0
