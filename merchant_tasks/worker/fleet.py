"""Which fleet a call belongs to: a call is run only by a worker of the fleet that sent it.

On the token store's Redis each fleet's Celery keys are its own (``worker.app``). Fleets that
share a broker of the user's choosing may still meet on one queue, so every ``call_api``
message carries, in its headers, the sending process's MERCHANT_KEY_PREFIX and a fingerprint
of the account it is meant for (a digest of its environment, API key and API origin; never
the secret). A worker whose prefix or account differs refuses the call with a
``ConfigurationError`` naming both prefixes, instead of running it with its own credentials
against its own API. Beat's ``renew_account`` messages name the sending fleet too: a worker
of another fleet refuses them (it would renew its own account of that name and free its
own claim). A header the sender could not fill (no MERCHANT_KEY_PREFIX set, no
account configured: a process that only enqueues) is left out, and a message without them
(an older release) is run as before.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

from merchant_tasks.accounts import load_accounts
from merchant_tasks.exceptions import ConfigurationError
from merchant_tasks.settings import PREFIX, Settings, environment, read_variable

log = logging.getLogger(__name__)

FLEET_HEADER = "merchant_fleet"  # the sender's MERCHANT_KEY_PREFIX
ACCOUNT_HEADER = "merchant_account"  # fingerprint of the account the call is meant for
FINGERPRINT_LENGTH = 16  # hex digits: tells accounts apart, says nothing usable about them
ACCOUNT_ARG = 4  # call_api's positional index of ``account``

_accounts_lock = threading.Lock()
_accounts: tuple[tuple[tuple[str, str], ...], dict[str, Settings] | None] | None = None


def this_fleet() -> str | None:
    """This process's MERCHANT_KEY_PREFIX, the name of its fleet; None when not set (a
    process that only enqueues may not know it: its calls name their account only)."""
    return read_variable("MERCHANT_KEY_PREFIX")


def account_fingerprint(settings: Settings) -> str:
    """A digest of what makes an account's credentials its own (no secret in it)."""
    text = f"{settings.environment}\n{settings.api_key}\n{settings.origin}"
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_LENGTH]


def _configured_accounts() -> dict[str, Settings] | None:
    """This process's accounts (secrets unread), loaded again when MERCHANT_* changes; None
    when it has none (a web process that only enqueues)."""
    global _accounts

    snapshot = tuple(sorted((k, v) for k, v in environment().items() if k.startswith(PREFIX)))
    with _accounts_lock:
        if _accounts is None or _accounts[0] != snapshot:
            try:
                loaded: dict[str, Settings] | None = load_accounts(read_secrets=False)
            except Exception as exc:  # the worker says what is wrong; a sender just tags less
                log.debug("no account fingerprint for sent calls: %s", type(exc).__name__)
                loaded = None
            _accounts = (snapshot, loaded)
        return _accounts[1]


def sender_account(accounts: dict[str, Settings], account: str | None) -> Settings | None:
    """The account a call names (or the default one) among ``accounts``; None if unknown."""
    if account is not None:
        return accounts.get(account)
    if len(accounts) == 1:
        return next(iter(accounts.values()))
    return accounts.get("default")


def tag_call(body: Any, headers: dict[str, Any]) -> None:
    """Add the sending fleet and account to the headers of a ``call_api`` message."""
    fleet = this_fleet()
    if fleet is not None:
        headers.setdefault(FLEET_HEADER, fleet)
    if ACCOUNT_HEADER in headers:
        return
    accounts = _configured_accounts()
    if not accounts:
        return
    args, kwargs = (body[0], body[1]) if isinstance(body, list | tuple) else ((), {})
    account = kwargs.get("account") if isinstance(kwargs, dict) else None
    if account is None and isinstance(args, list | tuple) and len(args) > ACCOUNT_ARG:
        account = args[ACCOUNT_ARG]
    settings = sender_account(accounts, account)
    if settings is not None:
        headers[ACCOUNT_HEADER] = account_fingerprint(settings)


def tag_renewal(headers: dict[str, Any]) -> None:
    """Add the sending fleet to the headers of a ``renew_account`` message."""
    fleet = this_fleet()
    if fleet is not None:
        headers.setdefault(FLEET_HEADER, fleet)


def foreign_renewal(request: Any, settings: Settings) -> str | None:
    """Why the ``renew_account`` in ``request`` is not this worker's to run (another fleet
    sent it), or None."""
    sender = getattr(request, FLEET_HEADER, None)
    ours = settings.fleet.key_prefix
    if sender is None or sender == ours:
        return None
    return (
        f"renewal {request.id} was sent by fleet {sender!r} (MERCHANT_KEY_PREFIX), this "
        f"worker serves {ours!r}: not run; fleets sharing a broker need their own queues or "
        "key prefix (docs/celery-app.md)"
    )


def refuse_foreign_call(request: Any, settings: Settings) -> None:
    """ConfigurationError if the call in ``request`` was sent by another fleet, or for
    another account than ``settings`` (this worker's account of that name)."""
    sender = getattr(request, FLEET_HEADER, None)
    ours = settings.fleet.key_prefix
    if sender is not None and sender != ours:
        raise ConfigurationError(
            f"call {request.id} was sent by fleet {sender!r} (MERCHANT_KEY_PREFIX), this worker "
            f"serves {ours!r}: refused, so that it never runs with another fleet's "
            "credentials; fleets sharing a broker need their own queues or key prefix "
            "(docs/celery-app.md)"
        )
    fingerprint = getattr(request, ACCOUNT_HEADER, None)
    if fingerprint is not None and fingerprint != account_fingerprint(settings):
        raise ConfigurationError(
            f"call {request.id} was sent for another account than this worker's of that "
            f"name in fleet {ours!r} (another API key, environment or MERCHANT_BASE_URL): "
            "refused, so that it never runs with another account's credentials; give "
            "fleets sharing a broker their own queues or key prefix (docs/celery-app.md)"
        )
