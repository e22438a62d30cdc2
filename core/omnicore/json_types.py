"""The JSON value types: what ``json.loads`` returns and ``json.dumps`` takes (a leaf: no omnicore imports).

Annotate a value that is JSON and nothing more with :data:`JSON` (or :data:`JSONObject` for an object), instead of
``Any``: readers then narrow it with ``isinstance`` before use, as they must for data from outside.
"""

from __future__ import annotations

from typing import TypeAlias

JSON: TypeAlias = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
JSONObject: TypeAlias = dict[str, JSON]

__all__ = ["JSON", "JSONObject"]
