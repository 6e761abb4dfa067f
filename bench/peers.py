"""The two peers ours is measured against, built the way their users build them.

(a) Per-process cache: authlib's ``OAuth2Session`` with ``grant_type="client_credentials"``,
    which fetches a new token by itself once ``expires_at - leeway`` has passed. The only
    adaptation is how the credentials travel: the API wants them in a JSON body
    (``{"grant_type": "client_credential", "appid", "secret"}``), not in HTTP Basic. Authlib
    1.9 has no ``access_token_request`` compliance hook (that hook is requests-oauthlib's);
    its extension point for a non-standard token request is a custom client-authentication
    method, ``register_client_auth_method``, which receives the prepared token request
    (method, uri, headers, body) and may rewrite it. Nothing else is changed: no lock, no
    401 handling beyond what authlib does (none).

(b) Shared Redis cache without a lock, as wechatpy-style SDKs do: GET the token (and its
    TTL) from Redis; if it is absent or has less than the advisory window left, exchange
    and SET it with EX = expires_in; on a 401, exchange again, SET, and retry once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import redis
import requests
from requests.adapters import HTTPAdapter

if TYPE_CHECKING:
    from authlib.integrations.requests_client import OAuth2Session

TOKEN_PATH = "/open-api/v1/auth/access_token"
JSON_CREDENTIALS = "merchant_json_credentials"  # the name of our client-auth method
POOL_SIZE = 32  # the same connection pool as MerchantClient's, for threaded callers

SessionT = TypeVar("SessionT", bound=requests.Session)


def _json_credentials(
    auth: Any, method: str, uri: str, headers: Any, body: Any
) -> tuple[str, Any, bytes]:
    """authlib client-auth method: send appid and secret as the API's JSON token request."""
    payload = {
        "grant_type": "client_credential",
        "appid": auth.client_id,
        "secret": auth.client_secret,
    }
    headers["Content-Type"] = "application/json"
    return uri, headers, json.dumps(payload).encode()


def authlib_session(
    base_url: str, api_key: str, secret: str, leeway: float, timeout: tuple[float, float]
) -> OAuth2Session:
    """A client-credentials OAuth2Session that renews ``leeway`` seconds before expiry."""
    from authlib.integrations.requests_client import OAuth2Session  # only peer (a) needs it

    session = OAuth2Session(
        client_id=api_key,
        client_secret=secret,
        token_endpoint=base_url + TOKEN_PATH,
        token_endpoint_auth_method=JSON_CREDENTIALS,
        grant_type="client_credentials",
        leeway=leeway,
        default_timeout=timeout,
    )
    session.register_client_auth_method((JSON_CREDENTIALS, _json_credentials))
    _pool(session)
    return session


@dataclass
class SharedNoLockClient:
    """A token cache in Redis shared by every process, with no lock and no compare-and-swap."""

    base_url: str
    api_key: str
    secret: str = field(repr=False)
    store: redis.Redis
    key: str
    advisory: float  # seconds: a token with less left is exchanged
    timeout: tuple[float, float]
    session: requests.Session = field(default_factory=lambda: _pool(requests.Session()))

    def token(self) -> str:
        pipe = self.store.pipeline(transaction=False)
        pipe.get(self.key)
        pipe.pttl(self.key)
        value, ttl_ms = cast(tuple[bytes | None, int], tuple(pipe.execute()))
        if value is None or ttl_ms < self.advisory * 1000:
            return self.exchange()
        return value.decode()

    def exchange(self) -> str:
        response = self.session.post(
            self.base_url + TOKEN_PATH,
            json={"grant_type": "client_credential", "appid": self.api_key, "secret": self.secret},
            headers={"accept": "application/json"},
            timeout=self.timeout,
        )
        response.raise_for_status()
        grant = response.json()
        token = str(grant["access_token"])
        self.store.set(self.key, token, ex=int(grant.get("expires_in", 7200)))
        return token

    def get(self, path: str) -> requests.Response:
        """GET ``path`` with the shared token; on 401 exchange, store, and retry once."""
        response = self._get(path, self.token())
        if response.status_code == 401:
            response = self._get(path, self.exchange())
        return response

    def _get(self, path: str, token: str) -> requests.Response:
        return self.session.get(
            self.base_url + path,
            headers={"accept": "application/json", "authorization": f"Bearer {token}"},
            timeout=self.timeout,
        )


def _pool(session: SessionT) -> SessionT:
    """Mount a connection pool sized for threaded callers, as MerchantClient does."""
    adapter = HTTPAdapter(pool_connections=4, pool_maxsize=POOL_SIZE)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session
