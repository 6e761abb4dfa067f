"""Completion records: a redelivered call whose earlier run succeeded is not run again.

Celery delivers ``call_api`` at least once and keeps the task id across redeliveries (a
failed acknowledgement, a worker lost after the task ended, the visibility timeout). When a
call succeeds, ``call_api`` writes ``<account namespace>:completed:<task id>`` holding the
call's JSON result, before the task returns and so before its message is acknowledged.
A delivery that finds the record returns that result without calling the API.

The record outlives the visibility timeout: a message whose acknowledgement was lost comes
back within that timeout (plus the restore sweep), or at once when its worker stops. It
holds the API's answer only, never a token or the secret.

While the store answers but refuses writes (out of memory, a read-only replica), a call
that passed the API waits for its record to be written, for at most the time ``call_api``
gives it: with one Redis for broker, results and tokens, the result and the acknowledgement
would be refused too, and a worker whose acknowledgements failed stops fetching
(docs/reliability.md, row 43).

What is left: the API answered but the worker died before the record was written; and two
deliveries running at once (a task outlasting the visibility timeout). Only an idempotency
key that the API understands closes those: ``call_api(..., idempotency_key=...)``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from merchant_tasks.exceptions import StoreRefusingWrites, StoreUnavailable
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.token import CounterName

log = logging.getLogger(__name__)

RECORD_TTL_FACTOR = 2  # records live twice the visibility timeout: a lost ack's redelivery
# comes within one timeout plus kombu's restore sweep (seconds to a few minutes)
RECORD_RETRY_PACE = 0.5  # seconds between writes of a record the store refused: calls go
# on within half a second of the store taking writes again


def once_writes_are_taken(
    write: Callable[[], None],
    patience: float,
    before_sleep: Callable[[RetryCallState], None] | None = None,
) -> float:
    """Run ``write``, again every ``RECORD_RETRY_PACE`` seconds while the store refuses
    writes (``StoreRefusingWrites``), for up to ``patience`` seconds; the seconds waited (0
    when the first write was taken). Raises the last refusal past the patience, and any
    other StoreUnavailable (an unreachable store) at once."""
    started = time.monotonic()
    retrying = Retrying(
        retry=retry_if_exception_type(StoreRefusingWrites),
        wait=wait_fixed(RECORD_RETRY_PACE),
        stop=stop_after_delay(patience),
        before_sleep=before_sleep,
        reraise=True,
    )
    retrying(write)
    return time.monotonic() - started if retrying.statistics["attempt_number"] > 1 else 0.0


@dataclass(frozen=True)
class Completed:
    """The result a call returned the first time it ran."""

    result: Any


class CompletionRecords:
    """One account's completion records, in its token store's Redis and namespace.

    Both methods are best effort: with the store unreachable a call goes ahead (its token
    may still come from the process's copy) and the guarantee falls back to at least once.
    """

    def __init__(self, store: TokenStore, ttl: float) -> None:
        self.store = store
        self.ttl = ttl

    def __repr__(self) -> str:
        return f"CompletionRecords(namespace={self.store.namespace!r})"

    def earlier_run(self, task_id: str) -> Completed | None:
        """The successful earlier run of ``task_id``, counted as a redelivery, or None."""
        try:
            record = self.store.records.load_completion(task_id)
            if record is None:
                return None
            self.store.records.count(CounterName.REDELIVERED)
        except StoreUnavailable as exc:
            log.warning("no completion record of call %s could be read (%s)", task_id, exc)
            return None
        log.warning(
            "call %s already succeeded: its result is returned, the API not called", task_id
        )
        return Completed(record["result"])

    def record(self, task_id: str, result: Any, patience: float = 0.0) -> None:
        """Remember that ``task_id`` succeeded with ``result`` (the API's decoded JSON).

        While the store answers but refuses writes (``StoreRefusingWrites``: out of memory,
        a read-only replica), try again every ``RECORD_RETRY_PACE`` seconds for up to
        ``patience`` seconds: the task has not returned, so its message is still
        unacknowledged, and when the record is written the result and the acknowledgement,
        usually on the same Redis, can be written too (docs/reliability.md, row 43). An
        unreachable store is not waited for: the call returns at once.
        """

        def warn_once(state: RetryCallState) -> None:
            if state.attempt_number == 1 and state.outcome is not None:
                log.warning(
                    "completion record of call %s not written yet (%s): the call waits, "
                    "trying again every %.1f s",
                    task_id,
                    state.outcome.exception(),
                    RECORD_RETRY_PACE,
                )

        def save() -> None:
            self.store.records.save_completion(task_id, result, self.ttl)

        try:
            waited = once_writes_are_taken(save, patience, before_sleep=warn_once)
        except StoreUnavailable as exc:  # unreachable, or refusing writes past the patience
            log.warning(
                "completion record of call %s not written (%s): a redelivery would call the "
                "API again",
                task_id,
                exc,
            )
            return
        if waited:
            log.warning("completion record of call %s written after %.1f s", task_id, waited)
