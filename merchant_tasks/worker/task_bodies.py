"""Celery tasks: thin wrappers over the client and the token manager.

``call_api`` decides how Celery should retry what the client raised, and answers a
redelivery of a call that already succeeded from its completion record (``worker.completions``)
instead of calling the API again; ``renew_token`` finds the accounts due for renewal and
sends ``renew_account`` for each, which asks the account's manager to renew if the advisory
window has begun. None sees a token or the secret in its arguments or result: the token
stays in Redis and in the worker's memory.

The tasks belong to no app here: ``install(app)`` (``worker.install``) registers them on the user's
Celery app or on the package's own. ``merchant_tasks.tasks.call_api`` and the others stand
for the task of the user's app install() ran on, from any thread (``install.sending_app``),
else of the package's own app (``celery -A merchant_tasks``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Reject
from celery.signals import worker_process_init
from celery.utils.time import get_exponential_backoff_interval
from kombu.exceptions import OperationalError

from merchant_tasks.accounts import AccountClients
from merchant_tasks.exceptions import (
    CredentialsRejected,
    MerchantError,
    PathForbidden,
    StoreRefusingWrites,
    StoreUnavailable,
    TokenRejected,
)
from merchant_tasks.renewal.due import claim_ttl
from merchant_tasks.settings import FleetSettings
from merchant_tasks.store.health import check_store
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.worker.completions import (
    RECORD_TTL_FACTOR,
    CompletionRecords,
    once_writes_are_taken,
)
from merchant_tasks.worker.fleet import foreign_renewal, refuse_foreign_call
from merchant_tasks.worker.routing import RENEWAL_QUEUE, VISIBILITY_TIMEOUT

if TYPE_CHECKING:  # the HTTP client is imported with an account's first client, in the
    # child that serves it: a worker's main process never builds one
    from merchant_tasks.accounts import FleetClient

log = logging.getLogger(__name__)

TRANSIENT_MAX_RETRIES = 8  # with the back-off below: about 10 minutes of an unavailable API
TRANSIENT_BACKOFF_FACTOR = 2  # seconds; doubles per retry, full jitter
COUNTDOWN_MAX = 300  # far below the broker's visibility timeout (3600 s), so no redelivery
REJECTED_RETRY_PACE = 60  # seconds between retries while the credentials are refused
WAIT_IN_PLACE = 120.0  # seconds a call waits in its worker slot, message unacknowledged,
# while Redis refuses writes: its retry cannot be published, or its completion record not
# written (docs/reliability.md, row 43); far below the visibility timeout

# every task of merchant-tasks by name: its function and Celery options, for install()
TASKS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {}

_clients: AccountClients | None = None
_clients_lock = threading.Lock()


def clients() -> AccountClients:
    """This process's clients, one per account, made after fork on first use."""
    global _clients
    if _clients is None:
        with _clients_lock:
            if _clients is None:
                _clients = AccountClients.from_env()
    return _clients


def use_clients(fleet: AccountClients | None) -> None:
    """Make ``fleet`` this process's clients; None: build them from the environment again
    on next use (the pytest plugin's eager fixture gives each test its own account)."""
    global _clients
    with _clients_lock:
        _clients = fleet


def client(account: str | None = None) -> FleetClient:
    """The client of ``account`` (the only or ``default`` account when None)."""
    return clients().get(account)


@worker_process_init.connect
def _forget_parent_clients(**_: Any) -> None:
    """A forked child must not share the parent's sockets: make its own on first use."""
    global _clients
    _clients = None


CALL_API = "merchant_tasks.call_api"
RENEW_TOKEN = "merchant_tasks.renew_token"
RENEW_ACCOUNT = "merchant_tasks.renew_account"


def task(name: str, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Record a task's function for install(), which registers it on an app under ``name``
    (``merchant_tasks.tasks`` gives callers the task of whichever app serves them)."""

    def record(run: Callable[..., Any]) -> Callable[..., Any]:
        TASKS[name] = (run, options)
        return run

    return record


def completion_records(api: FleetClient, conf: Any) -> CompletionRecords:
    """The completion records of ``api``'s account, kept past the broker's visibility timeout
    (from ``conf``, the configuration of the app running the task)."""
    options = conf.broker_transport_options or {}
    visibility_timeout = float(options.get("visibility_timeout", VISIBILITY_TIMEOUT))
    return CompletionRecords(api.manager.store, RECORD_TTL_FACTOR * visibility_timeout)


class _RetryNotPublished(Exception):
    """``Task.retry`` could not publish the retry: the call waits ``countdown`` in place."""

    def __init__(self, countdown: float, reason: BaseException) -> None:
        super().__init__(countdown, reason)
        self.countdown, self.reason = countdown, reason


def _retry(task: Any, exc: MerchantError, countdown: float, max_retries: int) -> NoReturn:
    """Celery's retry of ``task``, or _RetryNotPublished when the broker refused it.

    ``Task.retry`` publishes a copy of the message and raises ``Reject(requeue=False)``
    when that publish fails: the worker then drops the call. That happens whenever the
    broker refuses writes (a Redis out of memory or read-only, unreachable), which is when
    calls meet errors worth retrying most (docs/reliability.md, row 43).
    """
    try:
        raise task.retry(exc=exc, countdown=countdown, max_retries=max_retries)
    except Reject as rejected:
        raise _RetryNotPublished(countdown, rejected.reason) from exc


@task(CALL_API, bind=True)
def call_api(
    self: Any,
    method: str,
    path: str,
    json: Any = None,
    params: dict[str, Any] | None = None,
    account: str | None = None,
    idempotency_key: str | None = None,
    headers: dict[str, str] | None = None,
) -> Any:
    """Call the merchant API as ``account`` and return the decoded JSON body.

    A redelivery of a call that already succeeded returns that call's result without
    calling the API; a call another fleet sent is refused (``worker.fleet``).
    ``idempotency_key`` is sent as the ``Idempotency-Key`` header (give the
    same key to every attempt of one operation, e.g. the order id); ``headers`` are more
    request headers (never credentials: they show in Flower like every argument).

    A retry the broker refuses to take is not dropped: the call waits here, its message
    unacknowledged, for the countdown its retry would have had, and runs again, for up to
    ``WAIT_IN_PLACE`` seconds; then Celery's own outcome (the call dropped, logged).
    """
    task_id: str | None = self.request.id
    deadline = time.monotonic() + WAIT_IN_PLACE
    while True:
        try:
            return _call_once(
                self,
                task_id,
                deadline,
                method,
                path,
                json,
                params,
                account,
                idempotency_key,
                headers,
            )
        except _RetryNotPublished as unpublished:
            cause = type(unpublished.reason).__name__
            if time.monotonic() + unpublished.countdown > deadline:
                log.error(
                    "call %s dropped: its retry could not be published for %.0f s (%s); "
                    "check the broker (broker_url, MERCHANT_REDIS_URL by default)",
                    task_id,
                    WAIT_IN_PLACE,
                    cause,
                )
                raise Reject(unpublished.reason, requeue=False) from None
            log.warning(
                "call %s: its retry could not be published (%s): runs again here in %.1f s",
                task_id,
                cause,
                unpublished.countdown,
            )
            time.sleep(unpublished.countdown)


def _call_once(
    self: Any,
    task_id: str | None,
    deadline: float,
    method: str,
    path: str,
    json: Any,
    params: dict[str, Any] | None,
    account: str | None,
    idempotency_key: str | None,
    headers: dict[str, str] | None,
) -> Any:
    """One run of call_api's body; raises what ``Task.retry`` raises, or _RetryNotPublished."""
    try:
        api = client(account)
        fleet = clients()
        refuse_foreign_call(self.request, fleet.accounts[account or fleet.default_name()])
        records = completion_records(api, self.app.conf)
        earlier = records.earlier_run(task_id) if task_id else None
        if earlier is not None:
            return earlier.result
        result = api.request(
            method, path, json=json, params=params, headers=headers, idempotency_key=idempotency_key
        )
    except PathForbidden:
        raise  # the merchant lacks a permission for the path: trying again cannot help
    except (CredentialsRejected, TokenRejected) as exc:
        # the secret may be rotated meanwhile: retry slowly for a while, then fail clearly
        window = FleetSettings.from_env().rejected_retry_window
        _retry(self, exc, REJECTED_RETRY_PACE, int(window // REJECTED_RETRY_PACE))
    except MerchantError as exc:
        if not exc.retryable:
            raise
        countdown = get_exponential_backoff_interval(
            TRANSIENT_BACKOFF_FACTOR, self.request.retries, COUNTDOWN_MAX, full_jitter=True
        )
        retry_after = getattr(exc, "retry_after", None) or 0
        countdown = min(COUNTDOWN_MAX, max(1, countdown, retry_after))
        _retry(self, exc, countdown, TRANSIENT_MAX_RETRIES)
    if task_id:  # before the task returns, so before its result is stored and acknowledged
        records.record(task_id, result, patience=max(0.0, deadline - time.monotonic()))
    return result


def hold_while_refusing_writes(store: TokenStore) -> None:
    """Return once ``store`` takes writes again, or after ``WAIT_IN_PLACE`` seconds.

    A task that ends while its Redis refuses writes (out of memory, read-only) has its
    acknowledgement refused too, and kombu raises that in the worker's event loop: the
    worker stops ("Unrecoverable error"), its messages left unacknowledged for the
    visibility timeout (docs/reliability.md, row 43). With the broker on the token store's
    Redis (the default), holding the task until the store takes writes lets the
    acknowledgement through.
    """
    with contextlib.suppress(StoreUnavailable):  # unreachable, or refusing past the wait
        once_writes_are_taken(lambda: check_store(store), WAIT_IN_PLACE)


@task(RENEW_TOKEN, bind=True, ignore_result=True)
def renew_token(self: Any) -> None:
    """Beat's check of every account: one renewal task per account that is due.

    One pipelined round trip per Redis server, and no client built, when nothing is due
    (``renewal.due``); each due account is renewed by its own task, so a slow or failing
    account never delays another.
    """
    fleet = clients()
    try:
        due = fleet.due()
    except MerchantError as exc:
        log.warning("scheduled token check failed: %s", exc)  # beat ticks again soon
        if isinstance(exc, StoreRefusingWrites):  # every server refused its claims: with
            # the broker on the store's Redis (the default), its acknowledgement would be too
            hold_while_refusing_writes(fleet.get(next(iter(fleet.accounts))).manager.store)
        return
    for sent, name in enumerate(due):
        settings = fleet.accounts[name]
        # sent once while pending (see renewal.due); after the advisory window a renewal
        # nobody ran is dropped and beat sends another
        try:
            self.app.tasks[RENEW_ACCOUNT].apply_async(
                (name,), queue=RENEWAL_QUEUE, expires=claim_ttl(settings)
            )
        except OperationalError as exc:
            # the broker refuses it: the claims of what was not sent are released, so that
            # beat's next tick sends them
            log.warning(
                "renewal of account %s not sent (%s): beat sends it again", name, type(exc).__name__
            )
            for unsent in due[sent:]:
                with contextlib.suppress(MerchantError):
                    fleet.renewal_done(unsent)
            hold_while_refusing_writes(fleet.get(name).manager.store)
            return


@task(RENEW_ACCOUNT, bind=True, ignore_result=True)
def renew_account(self: Any, account: str) -> None:
    """Renew ``account``'s token if its advisory window has begun (sent by renew_token);
    one another fleet sent is not run (``worker.fleet``)."""
    fleet = clients()
    settings = fleet.accounts.get(account)
    refused = foreign_renewal(self.request, settings) if settings is not None else None
    if refused is not None:
        log.warning("%s", refused)  # its own claim and token are not this fleet's to touch
        return
    try:
        fleet.get(account).manager.renew()
    except MerchantError as exc:
        # beat checks again soon, and callers renew in the mandatory window; say why here
        log.warning("scheduled token renewal of account %s failed: %s", account, exc)
        if isinstance(exc, StoreRefusingWrites):
            hold_while_refusing_writes(fleet.get(account).manager.store)
    finally:
        with contextlib.suppress(MerchantError):  # the claim expires by itself
            fleet.renewal_done(account)
