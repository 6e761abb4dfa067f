"""The fenced code blocks of a Markdown page, each with the marker comment on the line just
above it (``<!-- using-it -->``, ``<!-- run: service -->``): how the tests find the
snippets of a page they run."""

from __future__ import annotations

import re
from dataclasses import dataclass

_BLOCK = re.compile(r"^(?:<!-- (.+?) -->\n)?```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    marker: str | None  # the comment's text, None when the line above is no marker
    language: str
    code: str


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text``, in order."""
    return [
        Block(marker or None, language, code) for marker, language, code in _BLOCK.findall(text)
    ]
