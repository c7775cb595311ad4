"""Option text: ``key=value,...`` as method specs and the CLI's ``--option`` write options, read and written in
one place (below the registry and the cache, which both use it)."""

from __future__ import annotations

from typing import Any


def parse_options(text: str, where: str = "") -> dict[str, str]:
    """``"key=value,key=value"`` -> ``{"key": "value", ...}`` (values as strings): the one parser of
    option text, for method specs and the CLI's ``--option``."""
    options: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad option {item!r}{where}: expected key=value")
        _add_once(options, key.strip(), value.strip(), where)
    return options


def merge_options(parts: list[dict[str, str]], where: str = "") -> dict[str, str]:
    """The options of several `parse_options` results in one dict; an option in two of them is refused, as
    within one."""
    merged: dict[str, str] = {}
    for part in parts:
        for key, value in part.items():
            _add_once(merged, key, value, where)
    return merged


def _add_once(options: dict[str, str], key: str, value: str, where: str) -> None:
    if key in options:
        raise ValueError(f"option {key!r} given twice{where} ({options[key]!r} and {value!r})")
    options[key] = value


def format_options(options: dict[str, Any]) -> str:
    """``{"key": value, ...}`` -> ``"key=value,..."``, as `parse_options` reads it (booleans as true/false)."""
    return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())
