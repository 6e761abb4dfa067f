"""docker-compose.yml as the deploy tests read it, and the Compose specification's schema."""

from __future__ import annotations

from typing import Any

import yaml

from support.paths import ROOT, SUPPORT

COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
# the Compose specification's schema (Apache-2.0, see compose-spec/LICENSE), as vendored by
# check-jsonschema 0.39.0
COMPOSE_SCHEMA = SUPPORT / "compose-spec" / "compose-spec.json"
