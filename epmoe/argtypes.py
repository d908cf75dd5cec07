"""argparse types that refuse a bad number, list or model when the command line is parsed
(exit 2, `argument --iters: 0 must be >= 1`) instead of a traceback, or a run of nonsense,
after minutes of measuring.

    p.add_argument("--iters", type=at_least(1), default=20)
    p.add_argument("--tokens", type=int_list(1), default="128,4096")
    p.add_argument("--recipes", type=name_list(RECIPES), default="bf16")
    p.add_argument("--budget-s", type=seconds, default=240.0)
    p.add_argument("--model", type=model_name, default="deepseek-v3")
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def at_least(lo: int):
    """An int >= lo."""
    def parse(text: str) -> int:
        v = _int(text)
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be >= {lo}")
        return v
    parse.__name__ = f"int>={lo}"
    return parse


def seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of seconds > 0")
    return v


def int_list(lo: int = 1):
    """Comma-separated ints, each >= lo, at least one -> a tuple."""
    one = at_least(lo)

    def parse(text: str) -> tuple[int, ...]:
        parts = text.split(",")
        if not text.strip() or any(not p.strip() for p in parts):
            raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated whole numbers, "
                                             f"e.g. 128,4096")
        return tuple(one(p.strip()) for p in parts)
    parse.__name__ = "list of ints"
    return parse


def name_list(choices: Iterable[str]):
    """Comma-separated names from `choices`, at least one, repeats dropped -> a tuple."""
    allowed = tuple(choices)

    def parse(text: str) -> tuple[str, ...]:
        got = [p.strip() for p in text.split(",")]
        bad = [p for p in got if p not in allowed]
        if not text.strip() or bad:
            what = ", ".join(map(repr, bad)) if len(got) > 1 else repr(text)
            raise argparse.ArgumentTypeError(f"{what} is not one of {', '.join(allowed)} "
                                             f"(comma-separated)")
        return tuple(dict.fromkeys(got))
    parse.__name__ = "names"
    return parse


def model_name(text: str) -> str:
    """A preset name or a Hugging Face config.json (or its folder) that epmoe can read."""
    from epmoe.config import get_preset

    try:
        get_preset(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def given_flags(args: argparse.Namespace, names: Iterable[str]) -> list[str]:
    """The flags among `names` (dest names, default None) that the command line gave, as
    typed: ["--run-steps", ...]; for refusing flags that mean nothing without another."""
    return ["--" + k.replace("_", "-") for k in names if getattr(args, k, None) is not None]
