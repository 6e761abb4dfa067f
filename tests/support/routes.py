"""The emulator's routes that tests call, and its count of the exchanges it granted."""

from __future__ import annotations

from merchant_tasks.sandbox.fixtures import MerchantSandbox

PING = "/open-api/v1/ping"  # answers {"ok": true} to a valid token
PAYMENTS = "/open-api/v1/payments"
REPORTS = "/open-api/v1/reports"  # the route tests forbid (SandboxConfig.forbidden_paths)


def exchanges(sandbox: MerchantSandbox) -> int:
    """The token exchanges the emulator granted so far."""
    return int(sandbox.app.counters()["exchanges"]["ok"])
