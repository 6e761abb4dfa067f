"""The leak searches' readers (the fault suite, the Celery leak test): every Redis value of a
key, and a needle found plainly or in base64."""

from __future__ import annotations

import base64
from typing import Any, cast

from merchant_tasks.store.topology import StoreClient


def redis_value(client: StoreClient, key: bytes) -> bytes:
    """A key and everything in it, read by type (members only, for sorted sets)."""
    kind = client.type(key)
    values: list[Any] = [key]
    if kind == b"string":
        values.append(client.get(key))
    elif kind == b"list":
        values += cast(list[bytes], client.lrange(key, 0, -1))
    elif kind == b"hash":
        for pair in cast(dict[bytes, bytes], client.hgetall(key)).items():
            values += pair
    elif kind == b"set":
        values += cast(set[bytes], client.smembers(key))
    elif kind == b"zset":
        values += cast(list[bytes], client.zrange(key, 0, -1))
    elif kind == b"stream":
        for entry_id, fields in cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(key)):
            values.append(entry_id)
            for pair in fields.items():
                values += pair
    elif kind != b"none":  # "none": expired since the scan
        raise AssertionError(f"no reader for Redis type {kind!r} (key {key!r})")
    return b"\n".join(v for v in values if isinstance(v, bytes))


def encoded_forms(needle: str) -> list[bytes]:
    """The needle, and the part of its base64 that shows at any offset (message bodies)."""
    raw = needle.encode()
    forms = [raw]
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + raw)
        core = encoded[4 if shift else 0 : (len(raw) + shift) // 3 * 4]
        forms += [core, core.replace(b"+", b"-").replace(b"/", b"_")]
    return forms


def shows(needle: str, text: bytes) -> bool:
    """Whether ``text`` holds the needle, plainly or in base64."""
    return any(form in text for form in encoded_forms(needle))
