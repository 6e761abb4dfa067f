"""The error tree (exceptions.py): every error keeps its fields through pickle, and its repr
shows the message and the fields that are set, never the excerpt."""

from __future__ import annotations

import pickle

import pytest

from merchant_tasks import exceptions
from merchant_tasks.exceptions import ApiUnavailable, MerchantError
from support.errors import FIELDS, every_error_class


def test_the_tests_below_see_every_error_of_the_module() -> None:
    defined = {
        c for c in vars(exceptions).values() if isinstance(c, type) and issubclass(c, MerchantError)
    }
    assert set(every_error_class()) == defined
    assert len(defined) >= 13


@pytest.mark.parametrize("cls", every_error_class(), ids=lambda c: c.__name__)
def test_every_error_survives_pickle_with_its_fields(cls: type[MerchantError]) -> None:
    back = pickle.loads(pickle.dumps(cls("what happened", **FIELDS)))  # noqa: S301
    assert (type(back), str(back), back.details()) == (cls, "what happened", FIELDS)


def test_repr_shows_the_message_and_the_fields_that_are_set_but_never_the_excerpt() -> None:
    error = ApiUnavailable("gave up", status=503, excerpt="free text of the body", retry_after=2.0)
    assert repr(error) == "ApiUnavailable('gave up', status=503, retry_after=2.0)"
    assert repr(MerchantError("plain")) == "MerchantError('plain')"


def test_fields_default_to_none_or_empty() -> None:
    error = MerchantError("plain")
    assert (error.status, error.code, error.excerpt, error.retry_after) == (None, None, "", None)
    assert error.details() == {}
