"""Completion records: a redelivered call whose earlier run succeeded is not run again.

Celery delivers ``call_api`` at least once and keeps the task id across redeliveries (a
failed acknowledgement, a worker lost after the task ended, the visibility timeout). When a
call succeeds, ``call_api`` writes ``<account namespace>:completed:<task id>`` holding the
call's JSON result, before the task returns and so before its message is acknowledged.
A delivery that finds the record returns that result without calling the API.

The record outlives the visibility timeout: a message whose acknowledgement was lost comes
back within that timeout (plus the restore sweep), or at once when its worker stops. It
holds the API's answer only, never a token or the secret.

What is left: the API answered but the worker died before the record was written; and two
deliveries running at once (a task outlasting the visibility timeout). Only an idempotency
key that the API understands closes those: ``call_api(..., idempotency_key=...)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

import redis

from .store import _unavailable_as_error as unavailable_as_error

RECORD_TTL_FACTOR = 2  # records live twice the visibility timeout: a lost ack's redelivery
# comes within one timeout plus kombu's restore sweep (seconds to a few minutes)
REDELIVERED_COUNTER = "redelivered_completed_calls"  # fleet-wide, in the account's counters


@dataclass(frozen=True)
class Completed:
    """The result a call returned the first time it ran."""

    result: Any


class CompletionRecords:
    """One account's completion records, in the token store's Redis under its namespace."""

    def __init__(self, client: redis.Redis, namespace: str, ttl: float) -> None:
        self.redis = client
        self.namespace = namespace
        self.ttl = ttl

    def __repr__(self) -> str:
        return f"CompletionRecords(namespace={self.namespace!r})"

    def key(self, task_id: str) -> str:
        return f"{self.namespace}:completed:{task_id}"

    def find(self, task_id: str) -> Completed | None:
        """The record of ``task_id``'s successful run, if there was one. One GET."""
        with unavailable_as_error():
            raw = self.redis.get(self.key(task_id))
        if raw is None:
            return None
        return Completed(json.loads(cast(bytes, raw))["result"])

    def record(self, task_id: str, result: Any) -> None:
        """Remember that ``task_id`` succeeded with ``result`` (the API's decoded JSON)."""
        with unavailable_as_error():
            self.redis.set(
                self.key(task_id), json.dumps({"result": result}), px=int(self.ttl * 1000)
            )
