"""Every error merchant-tasks raises, one tree.

```
MerchantError                      base; ``retryable`` says whether trying later can help;
│                                  fields status, code, excerpt, retry_after (None/"")
├── ConfigurationError             a setting is missing or invalid (names the variable)
│   ├── TokenUnreadable            the stored token is sealed with a key this process lacks
│   ├── WrongBaseUrl               the token endpoint is not at MERCHANT_BASE_URL (404/405,
│   │                              HTML, a redirect): never blamed on the credentials
│   └── MissingExtra               an optional part is not installed (names the extra)
├── StoreUnavailable               Redis cannot be reached                        retryable
│   └── StoreRefusingWrites        it answers but refuses writes (out of memory, read-only)
├── TokenExchangeError             the token endpoint did not give us a token
│   ├── CredentialsRejected        the API key or secret was refused (4xx)
│   ├── ExchangeRateLimited        429 from the token endpoint (``retry_after``)  retryable
│   ├── TokenEndpointUnavailable   5xx, timeout or connection failure             retryable
│   │   ├── ExchangesThrottled     no permit under the host's fleet-wide exchange rate
│   │   └── TokenEndpointMisrouted an endpoint that issued tokens answers as none does (a
│   │                              page, 404): an outage, until it lasts a minute
│   └── MalformedTokenResponse     2xx without a usable token                     retryable
├── BrokerUnavailable              Celery's broker did not take a call within     retryable
│                                  MERCHANT_ENQUEUE_TIMEOUT (names host:port)
├── RenewalTimeout                 another process held the renewal too long      retryable
├── TokenRejected                  401 on a token renewing cannot mend (never accepted)
│   └── PathForbidden              401 on one path only: the merchant lacks a permission for
│                                  it (names the path); not retried, no other call waits
└── ApiError                       a business call failed (``status``, ``code``, ``excerpt``)
    ├── ApiUnavailable             429/5xx/connection failure the client gave up on  retryable
    │   └── ApiOutcomeUnknown      a non-idempotent call failed after it may have been processed
    └── MalformedApiResponse       a 2xx whose body is not JSON
```

No message or field here ever contains a secret or a token: callers build them from status
codes, error codes and names only, and excerpts have the token blanked out. Every error
survives Celery's JSON result backend and pickle with its fields (see ``MerchantError``).
"""

from __future__ import annotations

LIKELY_CAUSES = (
    "Likely causes: the API key belongs to the other environment (check MERCHANT_ENVIRONMENT "
    "and MERCHANT_BASE_URL), the secret was reset in the dashboard, or API access was "
    "revoked for this merchant"
)


class MerchantError(Exception):
    """Base of every merchant-tasks error.

    Every field is also in ``args``, in the constructor's order, so the error is rebuilt
    with its fields wherever it is rebuilt from ``args``: Celery's JSON result backend
    stores ``args`` and calls ``cls(*args)`` (``celery.backends.base``), pickle does the
    same. Fields: ``status`` (HTTP status), ``code`` (the API's short error code),
    ``excerpt`` (the start of the error body, any token blanked), ``retry_after`` (seconds
    the server asked us to wait).
    """

    retryable: bool = False

    def __init__(
        self,
        message: str = "",
        status: int | None = None,
        code: str | None = None,
        excerpt: str = "",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, status, code, excerpt, retry_after)
        self.message = message
        self.status = status
        self.code = code
        self.excerpt = excerpt
        self.retry_after = retry_after

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        # no excerpt: repr reaches logs, Celery's task events and Flower, which hold no free
        # text from a body (it could echo what was sent); ``excerpt`` is for the caller
        shown = {k: v for k, v in self.details().items() if k != "excerpt"}
        fields = ", ".join(f"{name}={value!r}" for name, value in shown.items())
        return f"{type(self).__name__}({self.message!r}{', ' if fields else ''}{fields})"

    def details(self) -> dict[str, object]:
        """The fields that are set, for logs, the CLI and JSON output."""
        values = {
            "status": self.status,
            "code": self.code,
            "excerpt": self.excerpt,
            "retry_after": self.retry_after,
        }
        return {name: value for name, value in values.items() if value not in (None, "")}


class ConfigurationError(MerchantError):
    """A setting is missing or invalid; the message names the variable."""


class TokenUnreadable(ConfigurationError):
    """The stored token is sealed with a key this process does not have; no exchange is
    made over it. Set MERCHANT_TOKEN_KEY_FILE to the key the rest of the fleet uses."""


class WrongBaseUrl(ConfigurationError):
    """The token endpoint answered as no token endpoint does (404, 405, an HTML page, a
    redirect): MERCHANT_BASE_URL does not point at the API. A configuration error, not a
    refusal: it opens no pause on exchanges, so the next exchange after the fix is made."""


class MissingExtra(ConfigurationError):
    """A tool needs an optional dependency: ``pip install 'merchant-tasks[<extra>]'``."""


class StoreUnavailable(MerchantError):
    """The Redis token store cannot be reached; calls resume when it is back."""

    retryable = True


class StoreRefusingWrites(StoreUnavailable):
    """The token store answers but refuses writes: out of memory (``maxmemory`` with
    ``noeviction``) or a read-only replica (a failover under way). Reads still work, and
    writes usually come back within seconds, so a call that passed the API waits for its
    completion record to be written (``worker.completions``)."""


class TokenExchangeError(MerchantError):
    """The token endpoint did not give us a usable token."""


class CredentialsRejected(TokenExchangeError):
    """The token endpoint refused the API key or secret.

    Check MERCHANT_API_KEY and MERCHANT_API_SECRET; the secret may have been reset in the
    dashboard, or the key may belong to the other environment.
    """


class ExchangeRateLimited(TokenExchangeError):
    """The token endpoint answered 429; no exchange is made before ``retry_after`` seconds."""

    retryable = True


class TokenEndpointUnavailable(TokenExchangeError):
    """The token endpoint answered 5xx, timed out or could not be reached."""

    retryable = True


class TokenEndpointMisrouted(TokenEndpointUnavailable):
    """The token endpoint that issued this account's tokens answers as no token endpoint
    does (404, 405, an HTML page, a redirect): an ingress or a firewall in the way, most
    likely for a while. Retried like any outage; after a minute of it, ``WrongBaseUrl``."""


class ExchangesThrottled(TokenEndpointUnavailable):
    """No permit came within the wait under the token endpoint host's fleet-wide exchange
    rate (``store.exchange_rate``); ``retry_after`` says when one may. Not the account's fault:
    it opens no breaker."""


class MalformedTokenResponse(TokenExchangeError):
    """The token endpoint answered 2xx without a usable ``access_token``."""

    retryable = True


class BrokerUnavailable(MerchantError):
    """Celery's broker did not take a ``call_api`` within MERCHANT_ENQUEUE_TIMEOUT seconds
    (unreachable, restarting, not answering). The call was not queued, unless the broker
    hung after it had received it: send it again later, with the same idempotency key."""

    retryable = True


class RenewalTimeout(MerchantError):
    """Another process (or thread) held the renewal longer than we could wait for its token."""

    retryable = True


class TokenRejected(MerchantError):
    """The API refuses tokens that renewing cannot mend: one it never accepted, one refused
    again after renewals, or tokens revoked over and over (docs/design.md, "Refusals").

    Likely causes: the API key belongs to the other environment (sandbox vs production),
    the secret was reset in the dashboard, or API access was revoked for this merchant.
    """

    @classmethod
    def after_renewals(cls, renewals: int) -> TokenRejected:
        """A call whose token the API refused again after ``renewals`` renewals."""
        return cls(
            f"the API refused the token again after {renewals} renewals in one call "
            f"(HTTP 401). {LIKELY_CAUSES}"
        )


class PathForbidden(TokenRejected):
    """The API refuses the account's token on one path (HTTP 401) and a new token did not
    help: the merchant lacks a permission for that path, or, while no call of the account
    has succeeded yet, the key may be wrong (the message says which). The token stays, no
    other call waits or fails; ``call_api`` does not retry it (the next call to the path
    once the permission is granted succeeds)."""

    @classmethod
    def on(cls, route: str, *, accepted_elsewhere: bool = True) -> PathForbidden:
        """The error of a call to ``route`` (``renewal.life.route_of``), which the API
        refuses with a token it accepts on other paths (``accepted_elsewhere``), or with the
        replacement of a token it accepted there before, which no call has yet proven good
        elsewhere: a lost permission and a revoked access then look alike."""
        if not accepted_elsewhere:
            return cls(
                f"the API refuses this account's tokens on /open-api/v1/{route} (HTTP 401): "
                "it accepted the one before there, then refused it, and refused its "
                "replacement at once: the merchant may have lost a permission for this path. "
                "Each call to it is sent again, and succeeds once the access is back. If no "
                f"other path works either: {LIKELY_CAUSES}",
                status=401,
            )
        return cls(
            f"the API refuses this account's valid token on /open-api/v1/{route} (HTTP 401) "
            "though it accepts it on other paths: the merchant lacks a permission for this "
            "path (ask for it in the dashboard or from the API's support); calls to other "
            "paths go on",
            status=401,
        )


class ApiError(MerchantError):
    """A business call answered with an error status."""


class ApiUnavailable(ApiError):
    """The API kept answering 429/5xx or could not be reached, and the client gave up."""

    retryable = True


class ApiOutcomeUnknown(ApiUnavailable):
    """A call that is not idempotent (a POST with no idempotency key) timed out or got 502 or
    504: the server may have processed it, so neither the client nor Celery sends it again.
    Check the outcome with the API, or send such calls with an idempotency key."""

    retryable = False


class MalformedApiResponse(ApiError):
    """A business call answered 2xx with a body that is not JSON."""
