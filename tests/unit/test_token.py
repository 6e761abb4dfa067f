"""The token value: its state at each window boundary, its stored form, and what it shows."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from merchant_tasks.token import RenewalReason, Token, TokenState, fingerprint
from support.tokens import make_token

RENEW_BEFORE = 480.0
RENEW_MANDATORY = 120.0
NOW = 1_700_000_000.0
VALUE = "tok-5d1e0c77a9b24f6e8c1d"


@pytest.mark.parametrize(
    ("left", "expected"),
    [
        (7200.0, TokenState.FRESH),
        (RENEW_BEFORE + 0.001, TokenState.FRESH),
        (RENEW_BEFORE, TokenState.FRESH),  # exactly the advisory bound: not yet inside it
        (RENEW_BEFORE - 0.001, TokenState.ADVISORY),
        (RENEW_MANDATORY + 0.001, TokenState.ADVISORY),
        (RENEW_MANDATORY, TokenState.ADVISORY),  # exactly the mandatory bound: not yet inside
        (RENEW_MANDATORY - 0.001, TokenState.MANDATORY),
        (0.001, TokenState.MANDATORY),
        (0.0, TokenState.EXPIRED),  # expiry itself is unusable
        (-0.001, TokenState.EXPIRED),
        (-7200.0, TokenState.EXPIRED),
    ],
)
def test_state_at_each_window_boundary(left: float, expected: TokenState) -> None:
    assert (
        make_token(3, left=left, value=VALUE, now=NOW).state(NOW, RENEW_BEFORE, RENEW_MANDATORY)
        is expected
    )


def test_time_left_counts_down_to_expiry() -> None:
    token = make_token(3, left=300.0, value=VALUE, now=NOW)
    assert token.time_left(NOW) == 300.0
    assert token.time_left(NOW + 400.0) == -100.0


def test_repr_shows_the_fingerprint_and_generation_but_never_the_value() -> None:
    token = make_token(3, value=VALUE, now=NOW)
    text = repr(token)
    assert VALUE not in text
    assert VALUE not in str(token)
    assert VALUE not in f"{token!r} {token}"
    assert token.fingerprint in text
    assert "generation=3" in text


def test_to_json_and_from_json_round_trip() -> None:
    token = make_token(3, value=VALUE, now=NOW)
    assert Token.from_json(token.to_json()) == token
    assert Token.from_json(token.to_json().encode()) == token


def test_from_json_accepts_a_record_without_who_and_why() -> None:
    raw = json.dumps({"value": VALUE, "issued_at": 1.0, "expires_at": 2.0, "generation": 1})
    token = Token.from_json(raw)
    assert (token.renewed_by, token.reason) == ("", None)


@given(
    value=st.text(min_size=1),
    issued_at=st.floats(allow_nan=False, allow_infinity=False),
    lifetime=st.floats(min_value=0.001, max_value=1e9),
    generation=st.integers(min_value=1, max_value=2**53),
    renewed_by=st.text(),
    reason=st.sampled_from([None, *RenewalReason]),
)
@hypothesis_settings(database=None, deadline=None)
def test_any_token_survives_its_stored_form(
    value: str,
    issued_at: float,
    lifetime: float,
    generation: int,
    renewed_by: str,
    reason: RenewalReason | None,
) -> None:
    token = Token(value, issued_at, issued_at + lifetime, generation, renewed_by, reason)
    assert Token.from_json(token.to_json()) == token


def test_fingerprint_is_stable_short_hex_and_not_the_value() -> None:
    first, again = (
        make_token(3, value=VALUE, now=NOW),
        make_token(3, left=10.0, value=VALUE, now=NOW),
    )
    assert first.fingerprint == again.fingerprint == fingerprint(VALUE)
    assert len(first.fingerprint) == 12
    int(first.fingerprint, 16)  # hex digits only
    assert first.fingerprint not in VALUE
    assert VALUE not in first.fingerprint


def test_different_tokens_have_different_fingerprints() -> None:
    assert (
        make_token(3, value="tok-a", now=NOW).fingerprint
        != make_token(3, value="tok-b", now=NOW).fingerprint
    )


def test_a_token_is_immutable() -> None:
    token = make_token(3, value=VALUE, now=NOW)
    with pytest.raises(dataclasses.FrozenInstanceError):
        token.value = "other"  # type: ignore[misc]


def test_a_stored_tokens_time_left_is_read_from_its_expiry_and_garbage_has_none() -> None:
    token = Token("v", issued_at=0.0, expires_at=500.0, generation=1)
    assert Token.stored_time_left(token.to_json(), now=200.0) == 300.0
    for garbage in (b"not json", b"[]", b'{"expires_at": "x"}', b'{"expires_at": 1e999}'):
        assert Token.stored_time_left(garbage, now=200.0) == 0.0
