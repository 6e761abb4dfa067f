"""``MerchantAuth`` on the user's own HTTP clients (httpx.Client, httpx.AsyncClient, a
requests Session) against the emulator: the fleet's token, one replacement on a 401 and one
resend, the guards before anything is sent, no secret or token in its repr, and a client that
follows redirects (requests does not carry the token there; with httpx, which keeps it for
the same host, the page's 401 is not judged as the token's)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import requests

from merchant_tasks.accounts import FleetClient, client_for, close_client
from merchant_tasks.aio import async_client_for
from merchant_tasks.api.auth import MerchantAuth
from merchant_tasks.sandbox.emulator import SandboxApp, SandboxConfig
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.settings import Settings
from merchant_tasks.store.topology import async_redis_from_url
from support.routes import PING, REPORTS, exchanges

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

pytestmark = pytest.mark.integration

TOKEN_PATH = "/open-api/v1/auth/access_token"
SECRET = "merchant-auth-secret-91be"


@pytest.fixture
def merchant_sandbox_config() -> SandboxConfig:
    return SandboxConfig(api_key="auth-key", secret=SECRET, forbidden_paths=[REPORTS])


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


def test_an_httpx_client_signs_with_the_fleets_token_and_resends_once_after_a_revocation(
    blocking: FleetClient, merchant_sandbox: MerchantSandbox
) -> None:
    auth = MerchantAuth(blocking)
    with httpx.Client(base_url=merchant_sandbox.url, auth=auth) as http:
        assert http.get(PING).json() == {"ok": True}
        assert blocking.request("GET", PING) == {"ok": True}  # the same token
        assert exchanges(merchant_sandbox) == 1
        merchant_sandbox.app.revoke_all()
        answer = http.get(PING)
        assert answer.status_code == 200
        assert [r.status_code for r in answer.history] == [401]  # the refused first send
    assert exchanges(merchant_sandbox) == 2
    assert merchant_sandbox.app.counters()["calls"]["unauthorized"] == 1


def test_an_httpx_async_client_shares_one_replacement_among_concurrent_requests(
    merchant_settings: Settings, merchant_sandbox: MerchantSandbox
) -> None:
    async def scenario() -> list[int]:
        redis_client = async_redis_from_url(merchant_settings.fleet.redis_url)
        client = async_client_for(merchant_settings, redis_client)
        try:
            async with httpx.AsyncClient(
                base_url=merchant_sandbox.url, auth=MerchantAuth(client)
            ) as http:
                assert (await http.get(PING)).status_code == 200
                merchant_sandbox.app.revoke_all()
                answers = await asyncio.gather(*(http.get(PING) for _ in range(8)))
                return [answer.status_code for answer in answers]
        finally:
            await client.aclose()
            await redis_client.aclose()

    assert asyncio.run(scenario()) == [200] * 8
    assert exchanges(merchant_sandbox) == 2  # the first token and one replacement


def test_a_requests_session_signs_and_resends_once_after_a_revocation(
    blocking: FleetClient, merchant_sandbox: MerchantSandbox
) -> None:
    with requests.Session() as session:
        session.auth = MerchantAuth(blocking)
        assert session.get(merchant_sandbox.url + PING, timeout=10).json() == {"ok": True}
        merchant_sandbox.app.revoke_all()
        answer = session.get(merchant_sandbox.url + PING, timeout=10)
        assert answer.status_code == 200
        assert [r.status_code for r in answer.history] == [401]
    assert exchanges(merchant_sandbox) == 2


def test_a_path_that_lacks_a_permission_returns_its_401_and_pauses_nothing(
    blocking: FleetClient, merchant_sandbox: MerchantSandbox
) -> None:
    with httpx.Client(base_url=merchant_sandbox.url, auth=MerchantAuth(blocking)) as http:
        assert http.get(PING).status_code == 200
        for _ in range(3):
            assert http.get(REPORTS).status_code == 401  # the caller's answer to read
        assert http.get(PING).status_code == 200
    assert exchanges(merchant_sandbox) == 2  # one replacement proved it the path's


@pytest.mark.parametrize(
    ("url", "headers", "named"),
    [
        ("http://elsewhere.invalid/open-api/v1/ping", {}, "signs requests to"),
        ("{base}/admin/users", {}, "/open-api/v1"),
        ("{base}" + TOKEN_PATH, {}, "token"),
        ("{base}" + PING, {"Authorization": "Bearer mine"}, "Authorization"),
    ],
)
def test_requests_that_are_not_the_accounts_api_calls_are_refused_before_they_are_sent(
    blocking: FleetClient,
    merchant_sandbox: MerchantSandbox,
    url: str,
    headers: dict[str, str],
    named: str,
) -> None:
    target = url.format(base=merchant_sandbox.url)
    with httpx.Client(auth=MerchantAuth(blocking)) as http, pytest.raises(ValueError, match=named):
        http.get(target, headers=headers)
    with requests.Session() as session:
        session.auth = MerchantAuth(blocking)
        with pytest.raises(ValueError, match=named):
            session.get(target, headers=headers, timeout=10)
    counters = merchant_sandbox.app.counters()
    assert sum(counters["calls"].values()) == 0  # nothing reached the API
    assert sum(counters["exchanges"].values()) == 0


def test_an_auth_used_with_the_other_kind_of_client_says_what_to_build_it_with(
    blocking: FleetClient, merchant_sandbox: MerchantSandbox
) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(auth=MerchantAuth(blocking)) as http:
            await http.get(merchant_sandbox.url + PING)

    with pytest.raises(ValueError, match=r"no asyncio client for httpx\.AsyncClient"):
        asyncio.run(scenario())
    with pytest.raises(ValueError, match="needs the package's client"):
        MerchantAuth()


def test_the_auth_shows_no_secret_or_token(
    blocking: FleetClient, merchant_sandbox: MerchantSandbox
) -> None:
    auth = MerchantAuth(blocking)
    with httpx.Client(base_url=merchant_sandbox.url, auth=auth) as http:
        assert http.get(PING).status_code == 200
    [token] = merchant_sandbox.app.issued_tokens()
    for text in (repr(auth), str(auth), repr(blocking)):
        assert SECRET not in text
        assert token not in text


# -- a client that follows redirects: an API path redirected to a page answering 401 -------


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
