"""The ``merchant-tasks`` command line.

Exit codes a script can rely on: 0 success, 1 the API or the token endpoint failed,
2 usage or configuration error (click's own, and ConfigurationError), 3 Redis unavailable.
"""

from __future__ import annotations

import atexit
import gc
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from merchant_tasks.accounts import AccountClients
from merchant_tasks.exceptions import ConfigurationError, MerchantError, StoreUnavailable
from merchant_tasks.extras import package_version, require
from merchant_tasks.ops.status import (
    account_statuses,
    format_status,
    healthy,
    status_documents,
)
from merchant_tasks.settings import (
    SANDBOX_DEFAULT_PORT,
    TOKEN_LIFETIME,
    read_variable,
    refuse_unknown_names,
)
from merchant_tasks.variable_files import read_text_file

EXIT_FAILED = 1
EXIT_CONFIGURATION = 2
EXIT_STORE_UNAVAILABLE = 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it (128 + SIGINT)


@click.group()
@click.version_option(package_version(), prog_name="merchant-tasks")
def main() -> None:
    """Keep one fresh payment-API token per account for a Celery fleet."""


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Loopback address to bind.")
@click.option("--port", default=SANDBOX_DEFAULT_PORT, show_default=True, type=int)
@click.option("--api-key", help="[default: MERCHANT_API_KEY]")
@click.option(
    "--secret-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="File holding the API secret [default: MERCHANT_API_SECRET(_FILE)].",
)
@click.option(
    "--lifetime", default=float(TOKEN_LIFETIME), show_default=True, help="Token lifetime, seconds."
)
@click.option("--revoke-on-issue", is_flag=True, help="Issuing a token revokes earlier ones.")
@click.option("--rate-limit", type=int, help="Token exchanges allowed per --rate-window.")
@click.option("--rate-window", default=60.0, show_default=True, help="Seconds.")
@click.option("--token-latency", default=0.0, help="Seconds added to each token exchange.")
@click.option("--api-latency", default=0.0, help="Seconds added to each business call.")
@click.option("--token-error-rate", default=0.0, help="Share of exchanges answered 5xx (0-1).")
@click.option("--api-error-rate", default=0.0, help="Share of calls answered 5xx (0-1).")
@click.option("--shape", type=click.Choice(["top", "data"]), default="top", show_default=True)
@click.option("--no-expires-in", is_flag=True, help="Leave expires_in out of token responses.")
@click.option("--environment", default="sandbox", show_default=True, help="Label only.")
@click.option("--log-requests", is_flag=True, help="Log each request line (never bodies).")
@click.option(
    "--allow-network",
    is_flag=True,
    help="Allow a non-loopback --host (a private container network only: the control "
    "endpoints have no authentication).",
)
def sandbox(
    host: str,
    port: int,
    api_key: str | None,
    secret_file: Path | None,
    lifetime: float,
    revoke_on_issue: bool,
    rate_limit: int | None,
    rate_window: float,
    token_latency: float,
    api_latency: float,
    token_error_rate: float,
    api_error_rate: float,
    shape: str,
    no_expires_in: bool,
    environment: str,
    log_requests: bool,
    allow_network: bool,
) -> None:
    """Serve the local emulator of the merchant API.

    The secret comes from --secret-file or MERCHANT_API_SECRET (never a command-line
    argument, which other users of the machine could read).
    """
    with _exit_codes():
        require("sandbox", "merchant-tasks sandbox")
    from merchant_tasks.sandbox.emulator import SandboxApp, SandboxConfig, SandboxServer

    with _exit_codes():
        api_key, secret = _sandbox_credentials(api_key, secret_file)
    try:
        config = SandboxConfig(
            api_key=api_key,
            secret=secret,
            lifetime=lifetime,
            revoke_on_issue=revoke_on_issue,
            rate_limit=rate_limit,
            rate_window=rate_window,
            token_latency=token_latency,
            api_latency=api_latency,
            token_error_rate=token_error_rate,
            api_error_rate=api_error_rate,
            token_shape=shape,
            include_expires_in=not no_expires_in,
            environment=environment,
        )
        server = SandboxServer(
            SandboxApp(config), host, port, log_requests=log_requests, allow_network=allow_network
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    # the banner only once the port is bound: a busy port fails before anything is printed
    server.serve_forever(
        on_ready=lambda url: click.echo(
            f"merchant API sandbox for {api_key} on {url} (Ctrl-C stops)"
        )
    )


@main.command()
@click.option("--duration", default=40.0, show_default=True, help="Seconds of calls.")
@click.option("--rate", default=15.0, show_default=True, help="Calls enqueued per second.")
@click.option("--lifetime", default=20.0, show_default=True, help="Emulator token lifetime.")
@click.option("--workers", default=2, show_default=True, help="Worker processes.")
def demo(duration: float, rate: float, lifetime: float, workers: int) -> None:
    """Run the whole system locally: emulator, Redis, a worker and beat, with a live view."""
    with _exit_codes():
        require("demo", "merchant-tasks demo")
        refuse_unknown_names()  # the demo reads MERCHANT_REDIS_URL
    from merchant_tasks.ops.demo import run_demo

    try:
        summary = run_demo(duration=duration, rate=rate, lifetime=lifetime, workers=workers)
    except KeyboardInterrupt:  # its processes are stopped and its keys deleted by now
        click.echo("demo: interrupted; everything it started and wrote is gone", err=True)
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(0 if summary.healthy else EXIT_FAILED)


ACCOUNT_OPTION = click.option(
    "--account", help="Account name (needed when several are configured)."
)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON document, for scripts.")
def status(as_json: bool) -> None:
    """Show every account's token, renewals, breaker and counters (never a token).

    Exits 0 when every account has a usable token and no breaker is open, 1 otherwise.
    """
    with _without_collections(), _exit_codes(as_json=as_json):
        shown, all_healthy = _shown_statuses(as_json)
    click.echo(shown)
    sys.exit(0 if all_healthy else EXIT_FAILED)


def _shown_statuses(as_json: bool) -> tuple[str, bool]:
    """What `status` prints, and whether every account is healthy. What it read is freed
    on return: left alive until the interpreter's exit (10,000 accounts: more than a
    million objects), each was visited by the collection the exit makes."""
    with AccountClients.from_env(read_secrets=False) as fleet:
        if as_json:  # Redis only: needs no secret mounted
            documents = status_documents(fleet)
        else:
            statuses = account_statuses(fleet)
    if not as_json:
        text = "\n\n".join(format_status(s) for s in statuses.values())
        return text, all(s.healthy for s in statuses.values())
    # indented for a person at a terminal; one line for a pipe (10,000 accounts: a third of
    # the bytes, and no indenting pass)
    indent = 2 if sys.stdout.isatty() else None
    text = json.dumps({"accounts": documents}, indent=indent, sort_keys=True)
    return text, all(healthy(document) for document in documents)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=9808, show_default=True, type=int)
def metrics(host: str, port: int) -> None:
    """Serve Prometheus metrics for the whole fleet (read from Redis at each scrape)."""
    with _exit_codes():
        require("metrics", "merchant-tasks metrics")
    from prometheus_client import CollectorRegistry, start_http_server

    from merchant_tasks.ops.metrics import FleetCollector

    fleet = _clients(read_secrets=False)  # reads Redis only: needs no secret mounted

    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(lambda: account_statuses(fleet)))
    server, thread = start_http_server(port, addr=host, registry=registry)
    click.echo(f"metrics on http://{host}:{port}/metrics (Ctrl-C stops)")
    try:
        thread.join()
    except KeyboardInterrupt:
        server.shutdown()
    finally:
        fleet.close()


@main.command()
@click.option("--force", is_flag=True, help="Exchange now even if the token is fresh.")
@ACCOUNT_OPTION
def renew(force: bool, account: str | None) -> None:
    """Renew the token if due (or now with --force) and show the stored one."""
    from merchant_tasks.renewal.manager import process_owner  # tenacity: not for `status`

    with _exit_codes(), AccountClients.from_env() as fleet:
        manager = fleet.get(account).manager
        manager.store.load()  # the stored token's generation counts if the counter was evicted
        before = manager.store.generation()
        token = manager.renew(force=force)
    stored = f"generation {token.generation}, fingerprint {token.fingerprint}"
    if token.generation <= before:
        click.echo(f"not due: {stored} is still fresh (renewed by {token.renewed_by}); no exchange")
    elif token.renewed_by == process_owner():
        click.echo(f"exchanged: {stored}, renewed by {token.renewed_by} ({token.reason})")
    else:  # another process stored one meanwhile: it stands for ours
        click.echo(f"no exchange: {stored} was stored meanwhile by {token.renewed_by}")


@main.command()
@click.argument("method")
@click.argument("path")
@click.option("--json", "body", help="JSON request body.")
@ACCOUNT_OPTION
def call(method: str, path: str, body: str | None, account: str | None) -> None:
    """Call METHOD PATH through the shared token and print the JSON response."""
    try:
        payload: Any = json.loads(body) if body is not None else None
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--json") from None
    with _exit_codes(), AccountClients.from_env() as fleet:
        client = fleet.get(account)
        try:
            result = client.request(method, path, json=payload)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    click.echo(json.dumps(result, indent=2, sort_keys=True))


def _clients(read_secrets: bool = True) -> AccountClients:
    with _exit_codes():
        return AccountClients.from_env(read_secrets=read_secrets)


@contextmanager
def _without_collections() -> Iterator[None]:
    """No garbage collection inside: what `status` makes lives until it has printed, so the
    collections that 10,000 accounts' records set off would free nothing, and took a sixth
    of its time. Nor at the interpreter's exit: its collection visits every object still
    alive, the imports' included (redis-py's, OpenTelemetry's), and frees nothing that the
    process's end does not (30 ms of the 10,000 accounts' `status`)."""
    atexit.register(gc.freeze)  # atexit runs before the exit's collection
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def _exit_codes(as_json: bool = False) -> Iterator[None]:
    """Turn merchant-tasks errors into a message and the documented exit code.

    The message is one line on stderr with the error's fields (status, the API's error
    code, excerpt, retry_after) on a second line, or with ``as_json`` one JSON document on
    stdout: ``{"error": {"type": ..., "message": ..., <fields>}}``.
    """
    try:
        yield
    except MerchantError as exc:
        if as_json:
            error = {"type": type(exc).__name__, "message": str(exc), **exc.details()}
            click.echo(json.dumps({"error": error}, indent=2, sort_keys=True))
        else:
            click.echo(f"error: {type(exc).__name__}: {exc}", err=True)
            if exc.details():
                click.echo(
                    "  " + ", ".join(f"{k} {v!r}" for k, v in exc.details().items()), err=True
                )
        if isinstance(exc, ConfigurationError):
            sys.exit(EXIT_CONFIGURATION)
        if isinstance(exc, StoreUnavailable):
            sys.exit(EXIT_STORE_UNAVAILABLE)
        sys.exit(EXIT_FAILED)


def _sandbox_credentials(api_key: str | None, secret_file: Path | None) -> tuple[str, str]:
    """The emulator's key and secret: the options', else the account variables'."""
    refuse_unknown_names()
    api_key = api_key or read_variable("MERCHANT_API_KEY")
    secret = (
        read_text_file("--secret-file", secret_file)
        if secret_file is not None
        else read_variable("MERCHANT_API_SECRET")
    )
    if not (api_key and secret):
        raise click.UsageError(
            "set --api-key or MERCHANT_API_KEY, and --secret-file or MERCHANT_API_SECRET(_FILE)"
        )
    return api_key, secret


if __name__ == "__main__":
    main()
