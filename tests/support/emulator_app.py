"""An emulator app for unit tests, on a hand-driven clock, and its account: the key, the
secret and a token request that the emulator grants."""

from __future__ import annotations

import random
from typing import Any

from merchant_tasks.sandbox.emulator import SandboxApp, SandboxClock, SandboxConfig

API_KEY = "app_key_0123"
SECRET = "Secret-Value-That-Must-Never-Leak-42"
GOOD_BODY = {"grant_type": "client_credential", "appid": API_KEY, "secret": SECRET}


def make_app(sleeps: list[float] | None = None, seed: int = 0, **config: Any) -> SandboxApp:
    """An emulator on a hand-driven clock whose sleeps are recorded, not slept."""
    recorded: list[float] = [] if sleeps is None else sleeps
    return SandboxApp(
        SandboxConfig(API_KEY, SECRET, **config),
        clock=SandboxClock(monotonic=lambda: 1000.0),  # only advance() moves it
        sleep=recorded.append,
        rng=random.Random(seed),
    )
