"""The model of a token's life (``renewal.life``): its table, row by row, with no Redis and
no clock. docs/design.md, "The model", shows the same rows; ``test_the_design_pages_table_is
_this_one`` keeps the two together."""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_fixed

from merchant_tasks.exceptions import (
    CredentialsRejected,
    ExchangeRateLimited,
    RenewalTimeout,
    TokenEndpointMisrouted,
    TokenEndpointUnavailable,
    TokenRejected,
    WrongBaseUrl,
)
from merchant_tasks.flows import Clock, Done, Flow, Moment, advance, drive, next_try
from merchant_tasks.renewal import life
from merchant_tasks.renewal.life import (
    FORCED_BURST,
    FORCED_INTERVAL,
    MISROUTE_NAMED_AFTER,
    RATE_LIMITED_BACKOFF,
    REFUSED_BACKOFF,
    REFUSED_BACKOFF_MAX,
    RETRY_AFTER_MARGIN,
    UNAVAILABLE_BACKOFF,
    UNAVAILABLE_BACKOFF_MAX,
    Limits,
    Purpose,
    Verdict,
    judge,
    misrouted,
    pause_for,
    paused_error,
    refused_backoff,
    route_of,
)
from merchant_tasks.store.token_store import BreakerRecord
from merchant_tasks.token import BreakerKind, RenewalPolicy, RenewalReason, Token

NOW = 1_000_000.0
ROOT = Path(__file__).resolve().parents[3]


def record(**evidence: object) -> Token:
    """A stored token's record with the given evidence (valid for an hour)."""
    token = Token(value="tok", issued_at=NOW - 60, expires_at=NOW + 3600, generation=7)
    return replace(token, **evidence)  # type: ignore[arg-type]


# -- what a 401 means: (its row in docs/design.md's table, the case, the refused token's
# record, the route of the 401, the verdict)
TABLE: list[tuple[int, str, Token, str, Verdict]] = [
    (
        1,
        "a route judged to lack a permission, kept by the tokens since",
        record(accepted=True, routes=(("reports", 0.0),)),
        "reports",
        Verdict.FORBIDDEN,
    ),
    (
        2,
        "the token served calls on this very route",
        record(accepted=True, accepted_routes=("payments", "reports"), retry_route="reports"),
        "reports",
        Verdict.REVOKED,
    ),
    (
        3,
        "the route refused the token before, which the API accepted elsewhere, and this one",
        record(accepted=False, retry_route="reports", first_use_refusals=0),
        "reports",
        Verdict.FORBIDDEN,
    ),
    (
        3,
        "... also when the API accepts this one elsewhere",
        record(accepted=True, accepted_routes=("payments",), retry_route="reports"),
        "reports",
        Verdict.FORBIDDEN,
    ),
    (
        4,
        "the token served calls (elsewhere), then was refused: revoked",
        record(accepted=True, accepted_routes=("payments",)),
        "reports",
        Verdict.REVOKED,
    ),
    (
        5,
        "the route accepted the token before this one: a revocation, not the route",
        record(accepted=False, retry_route="ping", route_worked=True, first_use_refusals=0),
        "ping",
        Verdict.UNUSED,
    ),
    (
        6,
        "its calls are held back on this route, for a while more",
        record(first_use_refusals=1, retry_route="reports", routes=(("reports", NOW + 30),)),
        "reports",
        Verdict.HELD,
    ),
    (
        7,
        "... and once that is over, the token is replaced",
        record(first_use_refusals=1, retry_route="reports", routes=(("reports", NOW - 1),)),
        "reports",
        Verdict.UNUSED,
    ),
    (
        8,
        "refused on its first use, the first in a row: revoked before use",
        record(accepted=False, first_use_refusals=0),
        "ping",
        Verdict.UNUSED,
    ),
    (
        9,
        "the second in a row refused on one route, none accepted: a key or a permission",
        record(accepted=False, first_use_refusals=1, retry_route="reports"),
        "reports",
        Verdict.HELD,
    ),
    (
        10,
        "refused on a second route, none accepted: the credentials",
        record(accepted=False, first_use_refusals=1, retry_route="reports"),
        "payments",
        Verdict.CREDENTIALS,
    ),
]


@pytest.mark.parametrize(
    ("row", "case", "token", "route", "verdict"), TABLE, ids=[f"{t[0]}: {t[1]}" for t in TABLE]
)
def test_what_a_401_means(row: int, case: str, token: Token, route: str, verdict: Verdict) -> None:
    assert judge(token, route, NOW) == verdict


def test_every_verdict_has_a_row() -> None:
    assert {row[-1] for row in TABLE} == set(Verdict)


def test_a_401_without_a_route_is_the_tokens() -> None:
    """A call whose route is unknown (a replacement asked for by the token's record, not by
    a request) is judged on the token alone: never the route's."""
    held = record(accepted=False, first_use_refusals=1, retry_route="reports")
    assert judge(held, "", NOW) == Verdict.CREDENTIALS
    assert judge(record(accepted=True, retry_route="reports"), "", NOW) == Verdict.REVOKED


def test_the_design_pages_table_is_this_one() -> None:
    """docs/design.md's table of 401s names the verdicts of ``TABLE``, in its order."""
    page = (ROOT / "docs" / "design.md").read_text()
    section = page.split("## The model", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \|.*?\| `([A-Z_]+)` \|", section, flags=re.MULTILINE)
    assert {(int(number), name) for number, name in rows} == {
        (number, verdict.name) for number, *_, verdict in TABLE
    }
    assert [int(number) for number, _ in rows] == list(range(1, len(rows) + 1))


# -- routes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "route"),
    [
        ("/open-api/v1/ping", "ping"),
        ("/open-api/v1/payments", "payments"),
        ("/open-api/v1/payments/pay_81", "payments/*"),
        ("/open-api/v1/payments/pay_81?expand=1", "payments/*"),
        ("/open-api/v1/merchant/profile", "merchant/profile"),
        ("/open-api/v1/reports/2026-11", "reports/*"),
        ("/open-api/v1/customers/alice@example.com", "customers/*"),
        ("/open-api/v1/", "*"),
    ],
)
def test_a_route_names_resources_never_ids(path: str, route: str) -> None:
    assert route_of(path) == route


# -- the fleet's pauses ------------------------------------------------------------------------


def test_rejected_credentials_pause_a_minute_tied_to_them() -> None:
    pause = pause_for(CredentialsRejected("no"), None, NOW, 0.0, "fp-1")
    assert (pause.kind, pause.until, pause.secret_fingerprint) == (
        BreakerKind.REJECTED,
        NOW + 60.0,
        "fp-1",
    )


@pytest.mark.parametrize(("retry_after", "pause"), [(3.0, 3.0), (None, RATE_LIMITED_BACKOFF)])
def test_a_429_pauses_as_long_as_the_server_asked(retry_after: float | None, pause: float) -> None:
    record_ = pause_for(ExchangeRateLimited("429", retry_after=retry_after), None, NOW, 0.5, "")
    assert record_.kind == BreakerKind.RATE_LIMITED
    assert record_.until == NOW + pause + RETRY_AFTER_MARGIN


def test_an_endpoint_failing_pauses_longer_each_time_in_a_row_up_to_a_minute() -> None:
    pauses, previous = [], None
    for _ in range(8):
        previous = pause_for(TokenEndpointUnavailable("503"), previous, NOW, 0.999999, "")
        pauses.append(round(previous.until - NOW, 3))
    assert pauses[0] == pytest.approx(UNAVAILABLE_BACKOFF, rel=1e-3)
    assert pauses == sorted(pauses)
    assert max(pauses) == pytest.approx(UNAVAILABLE_BACKOFF_MAX, rel=1e-3)


def test_the_jitter_halves_a_pause_at_most() -> None:
    low = pause_for(TokenEndpointUnavailable("503"), None, NOW, 0.0, "")
    assert low.until - NOW == UNAVAILABLE_BACKOFF / 2


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        (BreakerKind.REJECTED, CredentialsRejected),
        (BreakerKind.RATE_LIMITED, ExchangeRateLimited),
        (BreakerKind.UNAVAILABLE, TokenEndpointUnavailable),
        (BreakerKind.REFUSED, TokenRejected),
        (BreakerKind.REVOKED, TokenRejected),
    ],
)
def test_what_callers_get_during_a_pause(kind: BreakerKind, error: type[Exception]) -> None:
    got = paused_error(BreakerRecord(kind, NOW + 5), 5.0)
    assert type(got) is error
    assert got.retry_after == 5.0  # when the pause ends at the latest, for every kind


@pytest.mark.parametrize(("in_a_row", "pause"), [(1, 60.0), (2, 120.0), (3, 240.0), (10, 1800.0)])
def test_the_back_off_after_refusals_in_a_row_doubles_to_half_an_hour(
    in_a_row: int, pause: float
) -> None:
    assert refused_backoff(in_a_row) == pause
    assert REFUSED_BACKOFF <= pause <= REFUSED_BACKOFF_MAX


# -- what an answer no token endpoint gives means ----------------------------------------------


def page() -> WrongBaseUrl:
    return WrongBaseUrl("the token endpoint answered HTTP 404", status=404)


def test_a_page_from_an_endpoint_that_never_issued_is_a_wrong_base_url() -> None:
    assert type(misrouted(page(), False, None, NOW)) is WrongBaseUrl


def test_a_page_from_the_endpoint_that_issued_the_tokens_is_an_outage() -> None:
    meaning = misrouted(page(), True, None, NOW)
    assert type(meaning) is TokenEndpointMisrouted
    assert meaning.retryable
    assert meaning.status == 404


def test_an_outage_of_pages_is_named_a_wrong_base_url_once_it_lasts() -> None:
    first = pause_for(TokenEndpointMisrouted("page"), None, NOW, 0.0, "")
    assert first.misrouted
    assert first.since == NOW
    later = NOW + MISROUTE_NAMED_AFTER - 1
    second = pause_for(TokenEndpointMisrouted("page"), first, later, 0.0, "")
    assert second.since == NOW  # the run of pages began then
    assert type(misrouted(page(), True, second, later)) is TokenEndpointMisrouted
    assert type(misrouted(page(), True, second, NOW + MISROUTE_NAMED_AFTER)) is WrongBaseUrl


def test_a_5xx_between_pages_starts_the_run_again() -> None:
    pages = pause_for(TokenEndpointMisrouted("page"), None, NOW, 0.0, "")
    failed = pause_for(TokenEndpointUnavailable("503"), pages, NOW + 30, 0.0, "")
    assert not failed.misrouted
    assert type(misrouted(page(), True, failed, NOW + 70)) is TokenEndpointMisrouted


# -- what a renewal is for ---------------------------------------------------------------------

POLICY = RenewalPolicy(renew_before=480, renew_mandatory=120)


@pytest.mark.parametrize(
    ("purpose", "token", "serves"),
    [
        (Purpose(RenewalReason.MANDATORY), record(), True),
        (Purpose(RenewalReason.MANDATORY), record(expires_at=NOW + 60), False),
        (Purpose(RenewalReason.MANDATORY), record(refused_at=NOW - 1), False),
        (Purpose(RenewalReason.SCHEDULED), record(expires_at=NOW + 300), False),
        (Purpose(RenewalReason.SCHEDULED), record(), True),
        (Purpose(RenewalReason.MANUAL, seen=7), record(), False),
        (Purpose(RenewalReason.MANUAL, seen=6), record(), True),
        (Purpose(RenewalReason.FORCED, stale=record(value="old", generation=6)), record(), True),
        (Purpose(RenewalReason.FORCED, stale=record()), record(), False),
        (
            Purpose(RenewalReason.FORCED, stale=record(value="old", generation=6)),
            record(refused_at=NOW - 1),
            False,
        ),
    ],
)
def test_which_token_serves_a_renewal(purpose: Purpose, token: Token, serves: bool) -> None:
    assert purpose.acceptable(token, NOW, POLICY) is serves


def test_no_token_serves_any_renewal() -> None:
    assert not Purpose(RenewalReason.MANDATORY).acceptable(None, NOW, POLICY)


# -- bounds ------------------------------------------------------------------------------------


def test_a_dead_holder_frees_the_lock_within_seconds_whatever_the_exchanges_timeouts() -> None:
    for timeout in (0.7, 13.05, 60.0):
        limits = Limits.for_exchange(timeout)
        assert limits.lease <= 2.0  # the bound is 5 s: lease + one exchange
        assert limits.heartbeat * 3 < limits.lease  # a live holder misses 3 beats first
        assert limits.wait == 2 * limits.renewal
        assert limits.renewal >= timeout * 3


def test_the_forced_allowance_lets_two_revocations_through_at_once() -> None:
    """Revocations 3.3 s apart are each replaced at once; revocations twice a second wait
    for one replacement per FORCED_INTERVAL after the first FORCED_BURST."""
    assert FORCED_BURST == 2
    assert FORCED_INTERVAL == 5.0


# -- flows and their drivers -------------------------------------------------------------------


def test_a_flow_is_driven_step_by_step_with_errors_thrown_in() -> None:
    def flow() -> Flow[str]:
        first = yield "ask"
        try:
            yield "fail"
        except KeyError:
            return f"{first} then recovered"
        return "never"

    def perform(step: str) -> str:
        if step == "fail":
            raise KeyError(step)
        return "answer"

    assert drive(flow(), perform) == "answer then recovered"
    started = flow()
    assert advance(started, None, None) == "ask"
    assert advance(started, "x", None) == "fail"
    assert advance(started, None, KeyError("k")) == Done("x then recovered")


def test_tenacity_decides_the_waits_and_the_driver_sleeps() -> None:
    policy = Retrying(
        retry=retry_if_exception_type(TimeoutError), wait=wait_fixed(2), stop=stop_after_attempt(3)
    )
    assert next_try(policy, 1, 0.0, 0.1, TimeoutError()) == 2
    assert next_try(policy, 3, 0.0, 5.0, TimeoutError()) is None  # stopped
    assert next_try(policy, 1, 0.0, 0.1, ValueError()) is None  # not retried


def test_the_model_does_no_io() -> None:
    """The model module imports neither Redis, HTTP, threads nor a clock: it can't block."""
    source = (ROOT / "merchant_tasks" / "renewal" / "life.py").read_text()
    imported = set(re.findall(r"^(?:from|import) ([\w.]+)", source, flags=re.MULTILINE))
    assert not imported & {
        "redis",
        "requests",
        "httpx",
        "threading",
        "time",
        "asyncio",
        "socket",
        "os",
    }
    assert not re.search(r"\b(time\.\w+|sleep)\(", source)  # no clock read, no sleep


def test_a_join_that_outlasts_the_wait_is_a_renewal_timeout() -> None:
    """Scripted: another thread of this process renews and never lands in time."""
    life_ = life.TokenLife(
        _NoStore(),  # type: ignore[arg-type]
        POLICY,
        Limits(renewal=1.0, wait=2.0),
        rng=random.Random(0),
    )
    stale = record(refused_at=NOW - 1)

    class Joined:
        leader, replacing = False, stale.generation

    ticks = iter(range(100, 200))

    def perform(step: object) -> object:
        if isinstance(step, Clock):
            return Moment(NOW, float(next(ticks)))
        if isinstance(step, life.Fly):
            return Joined()
        if isinstance(step, life.Await):
            return life.TIMED_OUT
        raise AssertionError(step)

    with pytest.raises(RenewalTimeout):
        drive(life_.refused(stale, ""), perform)


class _NoStore:
    namespace = "ns"
    account = ""
    seen_generation = 0
