"""Local emulator of the payment API's auth behaviour: the test server and the demo target.

Every body is JSON; every error body is {"error": "<code>", "message": "<text>"}.

Token exchange
  POST /open-api/v1/auth/access_token
       body {"grant_type": "client_credential", "appid": <api key>, "secret": <api secret>}
    200  {"access_token": "sbx_...", "token_type": "Bearer", "expires_in": <int seconds>}
         or, with token_shape="data", {"code": 0, "message": "ok", "data": {...the same...}};
         no expires_in when include_expires_in is false; with hand_back_live_token, the
         last token issued while it is live (not revoked, not expired), with its remaining
         lifetime in whole seconds (so 0 in its last second), as some servers do
    checked in this order:
    429  rate_limited, with Retry-After, beyond rate_limit requests per rate_window (an HTTP
         date with retry_after_date, read against the answer's Date header)
         (then token_latency is slept)
    <n>  an HTML page with status token_page_status when it is set (an ingress or a
         firewall answering for the API)
    5xx  injected_failure (status error_status) with probability token_error_rate
    405  method_not_allowed
    415  unsupported_media_type       content-type is not application/json
    400  invalid_json / invalid_body  body is not JSON / not a JSON object
    400  unsupported_grant_type       grant_type is not "client_credential"
    401  invalid_client               appid or secret wrong (neither is ever echoed);
                                      with key_family, any appid "<api key>.<name>" with
                                      the secret is right too (one emulator, many accounts)

Business endpoints, with Authorization: Bearer <token>
  GET  /open-api/v1/ping              200 {"ok": true}
  GET  /open-api/v1/merchant/profile  200 {"appid": <api key>, "environment": <label>}
  POST /open-api/v1/echo              200 {"echo": <JSON body>}; 400 invalid_json
  POST /open-api/v1/payments          201 {"id": "pay_<n>", "amount": ..., "status": "created"}
                                      from a JSON object with "amount"; 400 otherwise.
                                      With an Idempotency-Key header, a repeat of the key
                                      returns the first payment (201, Idempotent-Replayed:
                                      true) and creates none; 422 idempotency_key_reused
                                      when the body differs
  GET  /open-api/v1/payments/{id}     200 the payment; 404 not_found
  GET  /open-api/v1/reports           200 {"reports": []}
    checked in this order:
    401  missing_token / invalid_token / token_expired / token_revoked,
         with WWW-Authenticate: Bearer error="invalid_token";
         refused_by_api for every call, even with a fresh token, with refuse_all_calls
         (as an API does for a key the token endpoint accepts but the API does not);
         missing_permission for a path under one of forbidden_paths, even with a fresh
         token (a merchant without that permission)
         (then api_latency is slept)
    5xx  injected_failure (status error_status; Retry-After: 1 on 429 and 503)
    404  not_found for an unknown path; 405 method_not_allowed for a known path

Control endpoints: no auth, which is why the server binds to loopback unless told otherwise
  GET  /_sandbox/counters        200 the counters (see SandboxApp.counters)
  GET  /_sandbox/tokens          200 {"tokens": [every token ever issued]}
  POST /_sandbox/revoke-all      200 {"ok": true}
  POST /_sandbox/reset-secret    optional body {"secret": "..."}; 200 {"secret": <new secret>}
  GET  /_sandbox/config          200 the settable config fields
  POST /_sandbox/config          body {<field>: <value>, ...}; 200 the settable config fields;
                                 400 invalid_config for an unknown, unsettable or ill-typed field
  POST /_sandbox/clock           body {"advance": <seconds>}; 200 {"now": <emulator clock>}
  POST /_sandbox/reset-counters  200 {"ok": true}
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hmac
import ipaddress
import json
import math
import random
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import TYPE_CHECKING, Any

import requests

from merchant_tasks.extras import require
from merchant_tasks.settings import SANDBOX_DEFAULT_PORT, TOKEN_LIFETIME

require("sandbox", "the emulator (merchant_tasks.sandbox)")

from werkzeug.exceptions import HTTPException, MethodNotAllowed  # noqa: E402
from werkzeug.routing import Map, Rule  # noqa: E402
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server  # noqa: E402
from werkzeug.wrappers import Request, Response  # noqa: E402

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

DEFAULT_PORT = SANDBOX_DEFAULT_PORT  # the sandbox's default MERCHANT_BASE_URL points here
API_ROOT = "/open-api/v1"
TOKEN_PATH = f"{API_ROOT}/auth/access_token"
CONTROL_ROOT = "/_sandbox"
GRANT_TYPE = "client_credential"
# A visible prefix makes emulator tokens easy to spot in a leak search.
TOKEN_PREFIX = "sbx_"
SHUTDOWN_POLL = 0.1  # seconds; how quickly stop() returns
IDEMPOTENCY_HEADER = "Idempotency-Key"

EXCHANGE_OUTCOMES = ("ok", "rejected", "rate_limited", "failed")
# "rejected" counts 400/405 on a known endpoint, so such calls are counted somewhere.
CALL_OUTCOMES = ("ok", "unauthorized", "failed", "not_found", "rejected")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The fields settable at runtime, each with the test its value must pass and how to say so.
_SETTABLE: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lifetime": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "revoke_on_issue": (lambda v: isinstance(v, bool), "true or false"),
    "rate_limit": (lambda v: v is None or (_is_int(v) and v >= 1), "null or an integer >= 1"),
    "rate_window": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "token_latency": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "api_latency": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "token_error_rate": (lambda v: _is_number(v) and 0 <= v <= 1, "a number from 0 to 1"),
    "api_error_rate": (lambda v: _is_number(v) and 0 <= v <= 1, "a number from 0 to 1"),
    "error_status": (lambda v: _is_int(v) and 400 <= v <= 599, "a status from 400 to 599"),
    "token_shape": (lambda v: v in ("top", "data"), '"top" or "data"'),
    "include_expires_in": (lambda v: isinstance(v, bool), "true or false"),
    "environment": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "hand_back_live_token": (lambda v: isinstance(v, bool), "true or false"),
    "refuse_all_calls": (lambda v: isinstance(v, bool), "true or false"),
    "key_family": (lambda v: isinstance(v, bool), "true or false"),
    "forbidden_paths": (
        lambda v: isinstance(v, list) and all(isinstance(p, str) and p for p in v),
        "a list of paths",
    ),
    "token_page_status": (
        lambda v: v is None or (_is_int(v) and 300 <= v <= 599),
        "null or a status from 300 to 599",
    ),
    "retry_after_date": (lambda v: isinstance(v, bool), "true or false"),
}


@dataclass
class SandboxConfig:
    """How the emulated API behaves; see the module docstring."""

    api_key: str
    secret: str = field(repr=False)
    lifetime: float = TOKEN_LIFETIME
    revoke_on_issue: bool = False
    rate_limit: int | None = None
    rate_window: float = 60.0
    token_latency: float = 0.0
    api_latency: float = 0.0
    token_error_rate: float = 0.0
    api_error_rate: float = 0.0
    error_status: int = 503
    token_shape: str = "top"
    include_expires_in: bool = True
    environment: str = "sandbox"
    hand_back_live_token: bool = False
    refuse_all_calls: bool = False
    key_family: bool = False  # accept "<api_key>.<name>" too: many accounts, one secret
    forbidden_paths: list[str] = field(default_factory=list)  # refused for every token
    token_page_status: int | None = None  # the token endpoint answers an HTML page instead
    retry_after_date: bool = False  # a 429's Retry-After as an HTTP date, not seconds

    def __post_init__(self) -> None:
        # Messages name the field, never the value: the value may be the secret.
        for name in ("api_key", "secret"):
            if not (isinstance(getattr(self, name), str) and getattr(self, name)):
                raise ValueError(f"{name} must be a non-empty string")
        for name, (valid, expected) in _SETTABLE.items():
            if not valid(getattr(self, name)):
                raise ValueError(f"{name} must be {expected}")


class SandboxClock:
    """The emulator's clock: monotonic seconds plus an offset that tests advance.

    ``monotonic`` is the clock it extends; a unit test passes a fixed one, so that only
    ``advance`` moves time however slowly the machine runs.
    """

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._offset = 0.0
        self._lock = threading.Lock()

    def now(self) -> float:
        """Seconds on the emulator's clock."""
        return self._monotonic() + self._offset

    def advance(self, seconds: float) -> None:
        """Move the clock forward; like the monotonic clock it extends, it never goes back."""
        if not (_is_number(seconds) and seconds >= 0):
            raise ValueError("advance needs a number of seconds >= 0")
        with self._lock:
            self._offset += seconds


@dataclass
class _Token:
    expires_at: float
    revoked: bool = False


class _Refusal(Exception):
    """Raised while answering a request, to answer it with this error instead."""

    def __init__(
        self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(f"{status} {code}")
        self.code = code
        self.response = _json(status, {"error": code, "message": message}, headers)

    @classmethod
    def page(cls, status: int) -> _Refusal:
        """An HTML page with ``status``, as an ingress or a firewall answers."""
        refusal = cls(status, "page", "an HTML page")
        body = f"<html><body><h1>{status}</h1><p>Request blocked.</p></body></html>"
        refusal.response = Response(body, status, mimetype="text/html")
        return refusal


def _json(status: int, body: object, headers: Mapping[str, str] | None = None) -> Response:
    return Response(json.dumps(body), status, headers, mimetype="application/json")


def _unauthorized(code: str, message: str) -> _Refusal:
    return _Refusal(401, code, message, {"WWW-Authenticate": 'Bearer error="invalid_token"'})


def _json_body(request: Request) -> Any:
    try:
        return json.loads(request.get_data())
    except ValueError:  # also bytes that are not UTF-8
        raise _Refusal(400, "invalid_json", "the request body is not valid JSON") from None


def _json_object(request: Request) -> dict[str, Any]:
    body = _json_body(request)
    if not isinstance(body, dict):
        raise _Refusal(400, "invalid_body", "the request body must be a JSON object")
    return body


def _same(given: object, expected: str) -> bool:
    """Constant-time equality; a non-string never matches, as expected is never empty."""
    # surrogatepass: JSON can carry lone surrogates, which strict UTF-8 cannot encode.
    given_bytes = given.encode("utf-8", "surrogatepass") if isinstance(given, str) else b""
    return hmac.compare_digest(given_bytes, expected.encode("utf-8", "surrogatepass"))


# An API answers or refuses; it does not redirect, so no slash fixing.
_API_ROUTES = Map(
    [
        Rule(f"{API_ROOT}/ping", methods=["GET"], endpoint="ping"),
        Rule(f"{API_ROOT}/merchant/profile", methods=["GET"], endpoint="profile"),
        Rule(f"{API_ROOT}/echo", methods=["POST"], endpoint="echo"),
        Rule(f"{API_ROOT}/payments", methods=["POST"], endpoint="create_payment"),
        Rule(f"{API_ROOT}/payments/<id>", methods=["GET"], endpoint="get_payment"),
        Rule(f"{API_ROOT}/reports", methods=["GET"], endpoint="reports"),
    ],
    strict_slashes=False,
    merge_slashes=False,
)
_CONTROL_ROUTES = Map(
    [
        Rule(f"{CONTROL_ROOT}/counters", methods=["GET"], endpoint="counters"),
        Rule(f"{CONTROL_ROOT}/tokens", methods=["GET"], endpoint="tokens"),
        Rule(f"{CONTROL_ROOT}/revoke-all", methods=["POST"], endpoint="revoke_all"),
        Rule(f"{CONTROL_ROOT}/reset-secret", methods=["POST"], endpoint="reset_secret"),
        Rule(f"{CONTROL_ROOT}/config", methods=["GET", "POST"], endpoint="config"),
        Rule(f"{CONTROL_ROOT}/clock", methods=["POST"], endpoint="clock"),
        Rule(f"{CONTROL_ROOT}/reset-counters", methods=["POST"], endpoint="reset_counters"),
    ],
    strict_slashes=False,
    merge_slashes=False,
)


def _route(routes: Map, request: Request) -> tuple[str, str, dict[str, str]]:
    """The counter key ("GET /path/{id}"), endpoint and path arguments of a request."""
    try:
        rule, args = routes.bind_to_environ(request.environ).match(return_rule=True)
    except MethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.valid_methods or ()))
        raise _Refusal(405, "method_not_allowed", f"use {allowed}", {"Allow": allowed}) from None
    except HTTPException:
        raise _Refusal(404, "not_found", "no such endpoint") from None
    template = rule.rule.replace("<", "{").replace(">", "}")
    return f"{request.method} {template}", str(rule.endpoint), dict(args)


class SandboxApp:
    """The emulated payment API as a WSGI application; all its state sits behind one lock."""

    def __init__(
        self,
        config: SandboxConfig,
        clock: SandboxClock | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or SandboxClock()
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._tokens = _Tokens()  # behind self._lock
        self._payments = _Payments(self._lock)
        self._counters = _zero_counters()
        self._arrivals: Counter[str] = Counter()  # requests by path, never reset

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        request = Request(environ)
        with self._lock:
            self._arrivals[request.path] += 1
        if request.path == TOKEN_PATH:
            response = self._exchange(request)
        elif request.path == API_ROOT or request.path.startswith(f"{API_ROOT}/"):
            response = self._call(request)
        else:
            try:
                response = _control(self, request)
            except _Refusal as refusal:
                response = refusal.response
        return response(environ, start_response)

    def counters(self) -> dict[str, Any]:
        """Exchange, call and per-endpoint outcomes since the last reset, and live tokens."""
        with self._lock:
            now = self.clock.now()
            active = self._tokens.active(now)
            return {**copy.deepcopy(self._counters), "active_tokens": active}

    def arrived(self, path: str) -> int:
        """Requests that reached ``path`` so far, counted on arrival (before any latency or
        check): a test knows a call is under way before the emulator answers it."""
        with self._lock:
            return self._arrivals[path]

    def payments(self) -> list[dict[str, Any]]:
        """Every payment created, oldest first."""
        return self._payments.all()

    def issued_tokens(self) -> list[str]:
        """Every token ever issued, for leak searches."""
        with self._lock:
            return list(self._tokens.issued)

    def revoke_all(self) -> None:
        """Revoke every token issued so far."""
        with self._lock:
            self._tokens.revoke_all()

    def reset_secret(self, new_secret: str | None = None) -> str:
        """Replace the secret and revoke every earlier token, as a dashboard reset does."""
        secret = secrets.token_urlsafe(24) if new_secret is None else new_secret  # 32 chars
        if not (isinstance(secret, str) and secret):
            raise ValueError("the new secret must be a non-empty string")
        with self._lock:
            self.config.secret = secret
            self._tokens.revoke_all()
        return secret

    def configure(self, changes: Mapping[str, Any]) -> None:
        """Change settable config fields all at once, or none if any is invalid."""
        for name in changes:
            if name in ("api_key", "secret"):
                raise ValueError(f"{name} cannot be changed at runtime")
            if name not in _SETTABLE:
                raise ValueError(f"{name} is not a config field")
        with self._lock:
            dataclasses.replace(self.config, **changes)  # validates without touching the live one
            for name, value in changes.items():
                setattr(self.config, name, value)

    def reset_counters(self) -> None:
        with self._lock:
            self._counters = _zero_counters()

    def _snapshot(self) -> SandboxConfig:
        with self._lock:
            return copy.copy(self.config)

    def _exchange(self, request: Request) -> Response:
        try:
            response, outcome = self._issue(request), "ok"
        except _Refusal as refusal:
            response = refusal.response
            outcomes = {"rate_limited": "rate_limited", "injected_failure": "failed"}
            outcome = outcomes.get(refusal.code, "rejected")
        with self._lock:
            self._counters["exchanges"][outcome] += 1
        return response

    def _issue(self, request: Request) -> Response:
        with self._lock:
            wait = self._tokens.admit_exchange(self.config, self.clock.now())
        cfg = self._snapshot()
        if wait is not None:
            seconds = max(1, math.ceil(wait))
            retry_after = {"Retry-After": str(seconds)}
            if cfg.retry_after_date:  # against the Date header the server adds (wall clock)
                retry_after = {"Retry-After": formatdate(time.time() + seconds, usegmt=True)}
            raise _Refusal(429, "rate_limited", "too many token requests", retry_after)
        self._inject(cfg.token_latency, cfg.token_error_rate, cfg.error_status)
        if cfg.token_page_status is not None:
            raise _Refusal.page(cfg.token_page_status)
        if request.method != "POST":
            raise _Refusal(405, "method_not_allowed", "use POST", {"Allow": "POST"})
        if request.mimetype != "application/json":
            raise _Refusal(415, "unsupported_media_type", "content-type must be application/json")
        body = _json_object(request)
        if body.get("grant_type") != GRANT_TYPE:
            raise _Refusal(400, "unsupported_grant_type", f'grant_type must be "{GRANT_TYPE}"')
        with self._lock:  # so a secret reset cannot fall between the check and the issue
            cfg = self.config
            appid = body.get("appid")
            family = (
                cfg.key_family and isinstance(appid, str) and appid.startswith(cfg.api_key + ".")
            )
            appid_ok = _same(appid, cfg.api_key) or family
            # Compared even when the appid is wrong, so timing does not tell which one was.
            secret_ok = _same(body.get("secret"), cfg.secret)
            if not (appid_ok and secret_ok):
                raise _Refusal(401, "invalid_client", "unknown appid or wrong secret")
            now = self.clock.now()
            live = self._tokens.live(now) if cfg.hand_back_live_token else None
            if live is not None:
                token, lifetime = live, self._tokens.issued[live].expires_at - now
            else:
                if cfg.revoke_on_issue:
                    self._tokens.revoke_all()
                token, lifetime = TOKEN_PREFIX + secrets.token_urlsafe(32), cfg.lifetime
                self._tokens.issued[token] = _Token(expires_at=now + lifetime)
            grant: dict[str, Any] = {"access_token": token, "token_type": "Bearer"}
            if cfg.include_expires_in:
                grant["expires_in"] = int(lifetime)
            if cfg.token_shape == "data":
                grant = {"code": 0, "message": "ok", "data": grant}
        return _json(200, grant, {"Cache-Control": "no-store"})

    def _inject(self, latency: float, error_rate: float, status: int) -> None:
        """Sleep the configured latency (outside the lock), then maybe fail on purpose."""
        if latency > 0:
            self._sleep(latency)
        with self._lock:
            failing = error_rate > 0 and self._rng.random() < error_rate
        if failing:
            headers = {"Retry-After": "1"} if status in (429, 503) else None
            raise _Refusal(status, "injected_failure", f"injected failure ({status})", headers)

    def _call(self, request: Request) -> Response:
        try:
            self._authenticate(request)
            cfg = self._snapshot()
            self._inject(cfg.api_latency, cfg.api_error_rate, cfg.error_status)
            response, outcome = _answer(self, *_route(_API_ROUTES, request)[1:], request), "ok"
        except _Refusal as refusal:
            response = refusal.response
            outcomes = {"injected_failure": "failed", "not_found": "not_found"}
            default = "unauthorized" if response.status_code == 401 else "rejected"
            outcome = outcomes.get(refusal.code, default)
        with self._lock:
            self._counters["calls"][outcome] += 1
            with contextlib.suppress(_Refusal):  # unknown routes stay out of the bounded dict
                key = _route(_API_ROUTES, request)[0]
                self._counters["endpoints"].setdefault(key, dict.fromkeys(CALL_OUTCOMES, 0))
                self._counters["endpoints"][key][outcome] += 1
        return response

    def _authenticate(self, request: Request) -> None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or " " in token:
            raise _unauthorized("missing_token", "send Authorization: Bearer <access token>")
        with self._lock:
            record = self._tokens.issued.get(token)
            now = self.clock.now()
            refuse_all = self.config.refuse_all_calls
            forbidden = list(self.config.forbidden_paths)
        if refuse_all:
            raise _unauthorized("refused_by_api", "this API does not accept the token")
        if any(request.path.startswith(path) for path in forbidden):
            raise _unauthorized("missing_permission", "the merchant may not call this path")
        if record is None:
            raise _unauthorized("invalid_token", "unknown access token")
        if record.revoked:
            raise _unauthorized("token_revoked", "the access token was revoked")
        if now >= record.expires_at:
            raise _unauthorized("token_expired", "the access token has expired")


def _answer(app: SandboxApp, endpoint: str, args: dict[str, str], request: Request) -> Response:
    """The business endpoints, once the caller is authenticated."""
    if endpoint == "ping":
        return _json(200, {"ok": True})
    if endpoint == "profile":
        cfg = app._snapshot()
        return _json(200, {"appid": cfg.api_key, "environment": cfg.environment})
    if endpoint == "echo":
        return _json(200, {"echo": _json_body(request)})
    if endpoint == "create_payment":
        body = _json_object(request)
        if "amount" not in body:
            raise _Refusal(400, "invalid_body", "a payment needs an amount")
        return app._payments.create(body, request.headers.get(IDEMPOTENCY_HEADER))
    if endpoint == "reports":
        return _json(200, {"reports": []})
    return app._payments.get(args["id"])  # get_payment


class SandboxControl:
    """The control endpoints (CONTROL_ROOT) of an emulator in another process, over HTTP:
    `merchant-tasks sandbox`, or the bench's. In the same process, call its ``SandboxApp``."""

    def __init__(self, base_url: str, timeout: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout  # seconds a control request may take
        self.session = requests.Session()

    def __repr__(self) -> str:
        return f"SandboxControl(base_url={self.base_url!r})"

    def counters(self) -> dict[str, Any]:
        """``SandboxApp.counters``."""
        counters: dict[str, Any] = self._call("GET", "counters")
        return counters

    def configure(self, **changes: Any) -> dict[str, Any]:
        """``SandboxApp.configure``; the settable fields as they are now."""
        fields: dict[str, Any] = self._call("POST", "config", changes)
        return fields

    def revoke_all(self) -> None:
        """``SandboxApp.revoke_all``."""
        self._call("POST", "revoke-all")

    def close(self) -> None:
        self.session.close()

    def _call(self, method: str, name: str, body: Any = None) -> Any:
        url = f"{self.base_url}{CONTROL_ROOT}/{name}"
        answer = self.session.request(method, url, json=body, timeout=self.timeout)
        answer.raise_for_status()
        return answer.json()


def _control(app: SandboxApp, request: Request) -> Response:
    """The /_sandbox/ endpoints that tests and the command line drive the emulator with."""
    endpoint = _route(_CONTROL_ROUTES, request)[1]
    if endpoint == "counters":
        return _json(200, app.counters())
    if endpoint == "tokens":
        return _json(200, {"tokens": app.issued_tokens()})
    if endpoint == "revoke_all":
        app.revoke_all()
    elif endpoint == "reset_secret":
        new_secret = (_json_object(request) if request.get_data() else {}).get("secret")
        if new_secret is not None and not (isinstance(new_secret, str) and new_secret):
            raise _Refusal(400, "invalid_body", "secret must be a non-empty string")
        return _json(200, {"secret": app.reset_secret(new_secret)})
    elif endpoint == "config":
        try:
            app.configure(_json_object(request) if request.method == "POST" else {})
        except ValueError as exc:
            raise _Refusal(400, "invalid_config", str(exc)) from None
        cfg = app._snapshot()
        return _json(200, {name: getattr(cfg, name) for name in _SETTABLE})
    elif endpoint == "clock":
        try:  # nan is refused like any other non-number
            app.clock.advance(_json_object(request).get("advance", math.nan))
        except ValueError as exc:
            raise _Refusal(400, "invalid_body", str(exc)) from None
        return _json(200, {"now": app.clock.now()})
    else:  # reset_counters
        app.reset_counters()
    return _json(200, {"ok": True})


class _Tokens:
    """Every token issued, and the recent exchanges a rate limit counts (the app locks)."""

    def __init__(self) -> None:
        self.issued: dict[str, _Token] = {}  # in the order of issue
        self._exchange_times: deque[float] = deque()  # admitted exchanges in the rate window

    def active(self, now: float) -> int:
        return sum(not t.revoked and now < t.expires_at for t in self.issued.values())

    def revoke_all(self) -> None:
        for token in self.issued.values():
            token.revoked = True

    def live(self, now: float) -> str | None:
        """The last token issued, if it is neither revoked nor expired."""
        if not self.issued:
            return None
        last = next(reversed(self.issued))  # dicts keep the order of issue
        record = self.issued[last]
        return last if not record.revoked and now < record.expires_at else None

    def admit_exchange(self, cfg: SandboxConfig, now: float) -> float | None:
        """Record an exchange in the sliding window, or return the seconds until a slot frees."""
        if cfg.rate_limit is None:
            return None
        window = self._exchange_times
        while window and window[0] <= now - cfg.rate_window:
            window.popleft()
        if len(window) >= cfg.rate_limit:
            # The limit may have been lowered at runtime, so more than one may have to age out.
            return window[-cfg.rate_limit] + cfg.rate_window - now
        window.append(now)
        return None


def _zero_counters() -> dict[str, Any]:
    return {
        "exchanges": dict.fromkeys(EXCHANGE_OUTCOMES, 0),
        "calls": dict.fromkeys(CALL_OUTCOMES, 0),
        "endpoints": {},
    }


class _Payments:
    """The emulator's payments and their idempotency keys, behind the app's lock."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._by_id: dict[str, dict[str, Any]] = {}
        self._idempotent: dict[str, tuple[Any, dict[str, Any]]] = {}  # key -> (body, payment)

    def all(self) -> list[dict[str, Any]]:
        with self._lock:
            return copy.deepcopy(list(self._by_id.values()))

    def create(self, body: dict[str, Any], key: str | None) -> Response:
        """A new payment, or the first one made with ``key`` (same body only)."""
        with self._lock:
            if key is not None and key in self._idempotent:
                first_body, payment = self._idempotent[key]
                if first_body != body:
                    raise _Refusal(422, "idempotency_key_reused", "this key came with another body")
                return _json(201, payment, {"Idempotent-Replayed": "true"})
            payment_id = f"pay_{len(self._by_id) + 1}"
            payment = {"id": payment_id, "amount": body["amount"], "status": "created"}
            self._by_id[payment_id] = payment
            if key is not None:
                self._idempotent[key] = (body, payment)
        return _json(201, payment)

    def get(self, payment_id: str) -> Response:
        with self._lock:
            found = self._by_id.get(payment_id)
        if found is None:
            raise _Refusal(404, "not_found", "no such payment")
        return _json(200, found)


class _RequestHandler(WSGIRequestHandler):
    """Quiet unless asked; werkzeug's request lines carry no bodies either way."""

    # HTTP/1.1 answers, as a real API's; werkzeug's server still closes every connection
    # after its answer (Connection: close), so each request of a client opens a new one
    protocol_version = "HTTP/1.1"
    log_requests = False

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if self.log_requests:
            super().log_request(code, size)


class _LoggingRequestHandler(_RequestHandler):
    log_requests = True


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        return False


class SandboxServer:
    """Runs a SandboxApp on loopback, in a daemon thread or in the foreground."""

    def __init__(
        self,
        app: SandboxApp,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        log_requests: bool = False,
        allow_network: bool = False,
    ) -> None:
        # The control endpoints have no auth: they face a network only when asked to, as
        # on a container network that nothing outside the compose project can reach.
        if not allow_network and not _is_loopback(host):
            raise ValueError(
                f"the sandbox serves on loopback only, not {host} "
                "(allow_network=True / --allow-network for a private container network)"
            )
        self.app = app
        self.host = host
        self.port = port
        self.log_requests = log_requests
        self.url = ""
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> SandboxServer:
        """Bind and serve in a daemon thread; url is valid on return."""
        server = self._bind()
        self._thread = threading.Thread(
            target=server.serve_forever, args=(SHUTDOWN_POLL,), name="sandbox", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()  # werkzeug's serve_forever closes the socket as it returns
        if thread is not None:
            thread.join()

    def serve_forever(self, on_ready: Callable[[str], object] | None = None) -> None:
        """Serve in the foreground until interrupted; ``on_ready(url)`` once bound."""
        server = self._bind()
        if on_ready is not None:
            on_ready(self.url)
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever(SHUTDOWN_POLL)
        self._server = None

    def __enter__(self) -> SandboxServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _bind(self) -> BaseWSGIServer:
        if self._server is not None:
            raise RuntimeError("the sandbox server is already running")
        handler = _LoggingRequestHandler if self.log_requests else _RequestHandler
        server = make_server(self.host, self.port, self.app, threaded=True, request_handler=handler)
        self._server = server
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{server.server_port}"
        return server
