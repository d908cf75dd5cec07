"""Reading the small documents users hand to epmoe (plans, profiles, topologies, sweeps,
published tables): one place that says a file is missing or does not parse, naming the file
and what it was meant to be."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path


def read_doc(path, what: str, hint: str = "") -> dict:
    """The JSON (or, for a .toml name, TOML) document at `path`; ValueError naming `what` when
    the file is missing (`hint`: how to make one) or does not parse."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} {str(p)!r} does not exist{hint}")
    toml = p.suffix == ".toml"
    try:
        return tomllib.loads(p.read_text()) if toml else json.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} {str(p)!r} is not {'TOML' if toml else 'JSON'}: "
                         f"{exc}") from None


def is_int(v) -> bool:
    """A document's integer: an int, not a bool (JSON's true is Python's 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A document's number: an int or a float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)
