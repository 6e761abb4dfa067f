"""The shape of a bench scenario: it measures, and hands back one Result that carries its
JSON keys, its markdown table and its goals. The runner only runs scenarios and joins what
they found, so a new scenario is one class with a ``measure`` method, and its keys in
``json_keys.json``."""

from __future__ import annotations

import functools
import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from harness import Bench

JSON_KEYS = Path(__file__).resolve().parents[1] / "json_keys.json"  # the keys of the JSON
# line by scenario, and the run's own: scripts outside the project read them


@functools.cache
def json_keys() -> dict[str, Any]:
    """``JSON_KEYS``, read: ``scenarios`` (by name: ``keys``, ``optional_keys``), ``run``
    (the run's own keys) and ``nested`` (the keys of the run's objects)."""
    return dict(json.loads(JSON_KEYS.read_text()))


@dataclass(frozen=True)
class Goal:
    """One line of the report's goals: what we aim for and what was measured."""

    name: str
    target: str
    measured: str
    met: bool | None  # None: nothing to compare (the scenario measured no value)

    @property
    def verdict(self) -> str:
        return {True: "yes", False: "**no**", None: "n/a"}[self.met]


@dataclass(frozen=True)
class Table:
    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        lines = [
            "| " + " | ".join(self.header) + " |",
            "|" + "|".join("---" for _ in self.header) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass
class Result:
    """What one scenario found.

    ``json`` holds its keys of the report's last line; ``title`` and ``table`` make its
    markdown section, ``notes`` the paragraphs after the table; ``errors`` name the parts
    that could not run while the rest did.
    """

    title: str
    table: Table
    json: dict[str, Any]
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def section(self) -> str:
        return "\n\n".join([f"### {self.title}", self.table.markdown(), *self.notes])


class Scenario(ABC):
    """A measurement of the bench: its sizes are its fields, its findings one Result.

    ``keys`` are the keys of the JSON line it always emits when it ran (scripts outside
    the project read them), ``optional_keys`` those it emits only when something went
    wrong (errors by kind, refusals): both declared in ``json_keys.json``, under its name.
    """

    name: ClassVar[str]  # how progress lines, errors, --only and json_keys.json name it

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(json_keys()["scenarios"][self.name]["keys"])

    @property
    def optional_keys(self) -> tuple[str, ...]:
        return tuple(json_keys()["scenarios"][self.name].get("optional_keys", ()))

    @abstractmethod
    def measure(self, bench: Bench) -> Result:
        """Measure, raising (ScenarioError or any other) when the scenario cannot run."""

    def undeclared_keys(self, result: Result) -> str | None:
        """How ``result.json`` differs from the declared keys, or None. Declared keys may be
        missing only when part of the scenario could not run (``result.errors``)."""
        found = set(result.json)
        extra = found - set(self.keys) - set(self.optional_keys)
        missing = set() if result.errors else set(self.keys) - found
        problems = [f"emitted, not declared: {', '.join(sorted(extra))}"] if extra else []
        if missing:
            problems.append(f"declared, not emitted: {', '.join(sorted(missing))}")
        return f"{self.name}: JSON keys {'; '.join(problems)}" if problems else None


def compact(error: str, limit: int = 400) -> str:
    """One line for a report: the first line of an error and, if more, its last line."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if len(lines) > 1:
        lines = [lines[0].removesuffix("Traceback (most recent call last):").strip(), lines[-1]]
    text = " ... ".join(lines)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fmt(value: float | None, digits: int = 0) -> str:
    """A number for a table: thousands separated, "n/a" when there is none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def yes_no(ok: bool) -> str:
    return "yes" if ok else "no"
