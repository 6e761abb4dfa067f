"""Configuration: one typed object built from the environment (see README.md's table).

Every variable may instead be given as ``<NAME>_FILE``, the path of a file holding the
value, as container secrets are delivered. The secret is never copied into the settings:
``Secret`` reads it when an exchange needs it, so a new secret written to the file takes
effect at the next exchange without a restart.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from .exceptions import ConfigurationError
from .redis_topology import DEFAULT_SENTINEL_MASTER, is_sentinel_url, parse_sentinel_url
from .sealing import codec_for

ENVIRONMENTS = ("sandbox", "production")
SANDBOX_DEFAULT_PORT = 8480  # where `merchant-tasks sandbox` serves unless told otherwise
SANDBOX_DEFAULT_BASE_URL = f"http://127.0.0.1:{SANDBOX_DEFAULT_PORT}"  # the local emulator
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
DEFAULT_KEY_PREFIX = "merchant-tasks"
TOKEN_LIFETIME = 7200  # the API documents 7200 s as the lifetime when a response omits it
RENEW_BEFORE = 480  # the API asks to renew 5-10 min before expiry; beat renews in this window
RENEW_MANDATORY = 120  # under 2 min left, any caller renews rather than risk an expired call
RENEW_INTERVAL = 60  # beat checks once a minute, well inside the 6-minute advisory window
CONNECT_TIMEOUT = 3.05  # slightly above a multiple of 3 s, TCP's retransmission step
READ_TIMEOUT = 10.0  # a token exchange or API call slower than this is treated as failed
DEFAULT_TIMEOUTS = (CONNECT_TIMEOUT, READ_TIMEOUT)  # requests' (connect, read) pair
REJECTED_RETRY_WINDOW = 900  # call_api keeps retrying refused credentials this long: time to
# write a rotated secret to the secret file before the calls fail for good


class Secret:
    """The API secret, read on demand from a value or a file; never shown by repr or str."""

    __slots__ = ("_path", "_value")

    def __init__(self, value: str | None = None, *, path: Path | None = None) -> None:
        if (value is None) == (path is None):
            raise ValueError("give exactly one of value or path")
        self._value = value
        self._path = path

    def reveal(self) -> str:
        """Return the current secret, re-reading the file if it comes from one."""
        if self._path is None:
            assert self._value is not None
            return self._value
        try:
            value = self._path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigurationError(
                f"MERCHANT_API_SECRET_FILE: cannot read {self._path} ({exc.strerror})"
            ) from None
        if not value:
            raise ConfigurationError(f"MERCHANT_API_SECRET_FILE: {self._path} is empty")
        return value

    def __repr__(self) -> str:
        source = f"file {self._path}" if self._path is not None else "value"
        return f"Secret(<hidden {source}>)"

    __str__ = __repr__

    @property
    def path(self) -> Path | None:
        """The file the secret is read from, or None when it was given as a value."""
        return self._path

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a Secret is not serialisable: it must not leave the process")


@dataclass(frozen=True)
class FleetSettings:
    """What every process of the fleet shares whatever the account: Celery's part.

    Read without any account configured, so ``celery -A merchant_tasks`` can load its
    configuration (and say clearly what is wrong) before a worker looks for accounts.
    """

    redis_url: str = field(default=DEFAULT_REDIS_URL, repr=False)  # may hold a password
    key_prefix: str = DEFAULT_KEY_PREFIX
    renew_interval: float = RENEW_INTERVAL
    rejected_retry_window: float = REJECTED_RETRY_WINDOW

    def __post_init__(self) -> None:
        if is_sentinel_url(self.redis_url):
            parse_sentinel_url(self.redis_url, "MERCHANT_REDIS_URL")
        else:
            _check_url("MERCHANT_REDIS_URL", self.redis_url, ("redis", "rediss", "unix"))
        _check_seconds("MERCHANT_RENEW_INTERVAL", self.renew_interval)
        if not (self.rejected_retry_window >= 0 and math.isfinite(self.rejected_retry_window)):
            raise ConfigurationError(
                "MERCHANT_REJECTED_RETRY_WINDOW must be a finite number of seconds, 0 or more "
                "(0: a call with refused credentials fails at once)"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FleetSettings:
        """Build them from MERCHANT_* variables (and their *_FILE variants)."""
        env = _Environment(os.environ if environ is None else environ)
        return cls(
            redis_url=env.get("MERCHANT_REDIS_URL") or DEFAULT_REDIS_URL,
            key_prefix=env.get("MERCHANT_KEY_PREFIX") or DEFAULT_KEY_PREFIX,
            renew_interval=env.seconds("MERCHANT_RENEW_INTERVAL", RENEW_INTERVAL),
            rejected_retry_window=env.seconds(
                "MERCHANT_REJECTED_RETRY_WINDOW", REJECTED_RETRY_WINDOW
            ),
        )


@dataclass(frozen=True)
class Settings:
    """Validated configuration of one account (an environment and its API key)."""

    api_key: str
    secret: Secret = field(repr=False)
    environment: str = "sandbox"
    base_url: str = SANDBOX_DEFAULT_BASE_URL
    redis_url: str = field(default=DEFAULT_REDIS_URL, repr=False)  # may hold a password
    key_prefix: str = DEFAULT_KEY_PREFIX
    token_lifetime: float = TOKEN_LIFETIME
    renew_before: float = RENEW_BEFORE
    renew_mandatory: float = RENEW_MANDATORY
    renew_interval: float = RENEW_INTERVAL
    connect_timeout: float = CONNECT_TIMEOUT
    read_timeout: float = READ_TIMEOUT
    allow_insecure_http: bool = False
    redis_sentinel_master: str = DEFAULT_SENTINEL_MASTER
    redis_sentinel_password: str | None = field(default=None, repr=False)
    redis_cluster: bool = False
    token_key_file: str | None = None  # seals the token at rest (sealing.py)
    token_key_previous_file: str | None = None  # still opens tokens while rotating

    def __post_init__(self) -> None:
        if self.environment not in ENVIRONMENTS:
            raise ConfigurationError(
                f"MERCHANT_ENVIRONMENT must be one of {', '.join(ENVIRONMENTS)}, "
                f"not {self.environment!r}"
            )
        if not self.api_key:
            raise ConfigurationError("MERCHANT_API_KEY is required")
        _check_url("MERCHANT_BASE_URL", self.base_url, ("http", "https"))
        if (
            self.environment == "production"
            and urlsplit(self.base_url).scheme != "https"
            and not self.allow_insecure_http
        ):
            raise ConfigurationError(
                "MERCHANT_BASE_URL must be https:// in production "
                "(set MERCHANT_ALLOW_INSECURE_HTTP=1 only for a local test double)"
            )
        self._check_redis_topology()
        for name, value in (
            ("MERCHANT_TOKEN_LIFETIME", self.token_lifetime),
            ("MERCHANT_RENEW_BEFORE", self.renew_before),
            ("MERCHANT_RENEW_MANDATORY", self.renew_mandatory),
            ("MERCHANT_RENEW_INTERVAL", self.renew_interval),
            ("MERCHANT_CONNECT_TIMEOUT", self.connect_timeout),
            ("MERCHANT_READ_TIMEOUT", self.read_timeout),
        ):
            _check_seconds(name, value)
        if not self.renew_mandatory < self.renew_before < self.token_lifetime:
            raise ConfigurationError(
                "MERCHANT_RENEW_MANDATORY < MERCHANT_RENEW_BEFORE < MERCHANT_TOKEN_LIFETIME "
                f"must hold (got {self.renew_mandatory:g} < {self.renew_before:g} < "
                f"{self.token_lifetime:g})"
            )

    def _check_redis_topology(self) -> None:
        if is_sentinel_url(self.redis_url):
            parse_sentinel_url(self.redis_url, "MERCHANT_REDIS_URL")
            if self.redis_cluster:
                raise ConfigurationError(
                    "MERCHANT_REDIS_CLUSTER=1 needs the redis:// or rediss:// URL of a cluster "
                    "node in MERCHANT_REDIS_URL, not sentinel:// addresses"
                )
            if not self.redis_sentinel_master:
                raise ConfigurationError("MERCHANT_REDIS_SENTINEL_MASTER must not be empty")
        elif self.redis_cluster:
            _check_url("MERCHANT_REDIS_URL", self.redis_url, ("redis", "rediss"))
        else:
            _check_url(
                "MERCHANT_REDIS_URL", self.redis_url, ("redis", "rediss", "unix", "sentinel")
            )

    @property
    def account(self) -> str:
        """The account's name in keys and logs: environment and API key."""
        return f"{self.environment}:{self.api_key}"

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, read_secret: bool = True
    ) -> Settings:
        """Build settings from MERCHANT_* variables (and their *_FILE variants).

        ``read_secret=False``: the secret file is not read now, for processes that never
        exchange (the metrics exporter, ``status``), whose container has no secret mounted.
        """
        env = _Environment(os.environ if environ is None else environ)
        environment = env.get("MERCHANT_ENVIRONMENT") or "sandbox"
        base_url = env.get("MERCHANT_BASE_URL")
        if base_url is None:
            if environment == "production":
                raise ConfigurationError(
                    "MERCHANT_BASE_URL is required in production (the https URL of the API)"
                )
            base_url = SANDBOX_DEFAULT_BASE_URL
        api_key = env.get("MERCHANT_API_KEY")
        if not api_key:
            raise ConfigurationError("MERCHANT_API_KEY is required (the API Key, or appid)")
        fleet = FleetSettings.from_env(env.environ)
        return cls(
            api_key=api_key,
            secret=env.secret(read=read_secret),
            environment=environment,
            base_url=base_url.rstrip("/"),
            redis_url=fleet.redis_url,
            key_prefix=fleet.key_prefix,
            token_lifetime=env.seconds("MERCHANT_TOKEN_LIFETIME", TOKEN_LIFETIME),
            renew_before=env.seconds("MERCHANT_RENEW_BEFORE", RENEW_BEFORE),
            renew_mandatory=env.seconds("MERCHANT_RENEW_MANDATORY", RENEW_MANDATORY),
            renew_interval=fleet.renew_interval,
            connect_timeout=env.seconds("MERCHANT_CONNECT_TIMEOUT", CONNECT_TIMEOUT),
            read_timeout=env.seconds("MERCHANT_READ_TIMEOUT", READ_TIMEOUT),
            allow_insecure_http=env.flag("MERCHANT_ALLOW_INSECURE_HTTP"),
            redis_sentinel_master=env.get("MERCHANT_REDIS_SENTINEL_MASTER")
            or DEFAULT_SENTINEL_MASTER,
            redis_sentinel_password=env.get("MERCHANT_REDIS_SENTINEL_PASSWORD") or None,
            redis_cluster=env.flag("MERCHANT_REDIS_CLUSTER"),
            **env.token_keys(),
        )

    def to_env(self) -> dict[str, str]:
        """The MERCHANT_* variables that ``from_env`` turns back into these settings.

        For child processes (a worker, beat, the demo's fleet): the secret is passed as
        MERCHANT_API_SECRET_FILE when it comes from a file, else as MERCHANT_API_SECRET.
        """
        env = {
            "MERCHANT_ENVIRONMENT": self.environment,
            "MERCHANT_BASE_URL": self.base_url,
            "MERCHANT_API_KEY": self.api_key,
            "MERCHANT_REDIS_URL": self.redis_url,
            "MERCHANT_KEY_PREFIX": self.key_prefix,
            "MERCHANT_TOKEN_LIFETIME": repr(float(self.token_lifetime)),
            "MERCHANT_RENEW_BEFORE": repr(float(self.renew_before)),
            "MERCHANT_RENEW_MANDATORY": repr(float(self.renew_mandatory)),
            "MERCHANT_RENEW_INTERVAL": repr(float(self.renew_interval)),
            "MERCHANT_CONNECT_TIMEOUT": repr(float(self.connect_timeout)),
            "MERCHANT_READ_TIMEOUT": repr(float(self.read_timeout)),
            "MERCHANT_ALLOW_INSECURE_HTTP": "1" if self.allow_insecure_http else "0",
            "MERCHANT_REDIS_SENTINEL_MASTER": self.redis_sentinel_master,
            "MERCHANT_REDIS_CLUSTER": "1" if self.redis_cluster else "0",
        }
        if self.redis_sentinel_password is not None:
            env["MERCHANT_REDIS_SENTINEL_PASSWORD"] = self.redis_sentinel_password
        if self.token_key_file is not None:
            env["MERCHANT_TOKEN_KEY_FILE"] = self.token_key_file
        if self.token_key_previous_file is not None:
            env["MERCHANT_TOKEN_KEY_PREVIOUS_FILE"] = self.token_key_previous_file
        if self.secret.path is not None:
            env["MERCHANT_API_SECRET_FILE"] = str(self.secret.path)
        else:
            env["MERCHANT_API_SECRET"] = self.secret.reveal()
        return env


def read_variable(environ: Mapping[str, str], name: str) -> str | None:
    """One variable or its ``_FILE`` variant, as ``Settings.from_env`` reads it."""
    return _Environment(environ).get(name)


def child_env(settings: Settings, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) without any MERCHANT_* or CELERY_*
    variable, plus ``settings.to_env()``: a child process configured by nothing else."""
    inherited = os.environ if base is None else base
    env = {k: v for k, v in inherited.items() if not k.startswith(("MERCHANT_", "CELERY_"))}
    env.update(settings.to_env())
    return env


class _Environment:
    """Reads variables with their *_FILE variants and names the variable in every error."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ

    @property
    def environ(self) -> Mapping[str, str]:
        return self._environ

    def get(self, name: str) -> str | None:
        value = self._environ.get(name)
        path = self._environ.get(f"{name}_FILE")
        if value is not None and path is not None:
            raise ConfigurationError(f"set either {name} or {name}_FILE, not both")
        if path is not None:
            try:
                return Path(path).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigurationError(
                    f"{name}_FILE: cannot read {path} ({exc.strerror})"
                ) from None
        return value.strip() if value is not None else None

    def secret(self, read: bool = True) -> Secret:
        value = (self._environ.get("MERCHANT_API_SECRET") or "").strip()
        path = self._environ.get("MERCHANT_API_SECRET_FILE")
        if value and path:
            raise ConfigurationError(
                "set either MERCHANT_API_SECRET or MERCHANT_API_SECRET_FILE, not both"
            )
        if path:
            secret = Secret(path=Path(path))
            if read:
                secret.reveal()  # fail at start-up, not at the first exchange
            return secret
        if not value:
            raise ConfigurationError(
                "MERCHANT_API_SECRET or MERCHANT_API_SECRET_FILE is required (the API Secret)"
            )
        return Secret(value)

    def token_keys(self) -> dict[str, str | None]:
        """The token key files, checked now (readable, 32 bytes, cryptography installed)."""
        key_file = self._environ.get("MERCHANT_TOKEN_KEY_FILE") or None
        previous_file = self._environ.get("MERCHANT_TOKEN_KEY_PREVIOUS_FILE") or None
        codec_for(key_file, previous_file)
        return {"token_key_file": key_file, "token_key_previous_file": previous_file}

    def seconds(self, name: str, default: float) -> float:
        raw = self.get(name)
        if raw is None or raw == "":
            return default
        try:
            return float(raw)
        except ValueError:
            raise ConfigurationError(f"{name} must be a number of seconds, not {raw!r}") from None

    def flag(self, name: str) -> bool:
        raw = (self.get(name) or "").lower()
        if raw in ("", "0", "false", "no", "off"):
            return False
        if raw in ("1", "true", "yes", "on"):
            return True
        raise ConfigurationError(f"{name} must be 1/true/yes or 0/false/no, not {raw!r}")


def _check_seconds(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigurationError(f"{name} must be a positive, finite number of seconds")


def _check_url(name: str, url: str, schemes: tuple[str, ...]) -> None:
    parts = urlsplit(url)
    if parts.scheme not in schemes or not (parts.netloc or parts.scheme == "unix"):
        raise ConfigurationError(
            # the URL is not echoed: a Redis URL may carry a password
            f"{name} must be a {' or '.join(s + '://' for s in schemes)} URL with a host"
        )
