"""`--backend auto` by measurement: per backend, recipe and world, the time of dispatch + combine
per rank at a few token counts (`auto_table.json` next to this file, written by
`python -m epmoe.bench.comm --auto-table FILE` on the machine kind it describes).

A backend is a candidate only where the table measured it (token counts inside its measured
range: a low-latency path measured up to 256 tokens is never extrapolated to 4096); between
two measured counts the time is interpolated linearly. No table, or none for this world and
recipe: the caller falls back to its fixed rule, and says so.
"""

from __future__ import annotations

import json
from pathlib import Path

TABLE = Path(__file__).with_name("auto_table.json")


def load_table(path: Path = TABLE) -> dict | None:
    if not path.exists():
        return None
    with open(path) as f:
        return json.load(f)


def _time_at(points: list, tokens: int) -> float | None:
    """Linear interpolation of [(tokens, us)] at `tokens`; None outside the measured range."""
    pts = sorted((int(t), float(us)) for t, us in points)
    if not pts or not pts[0][0] <= tokens <= pts[-1][0]:
        return None
    for (t0, u0), (t1, u1) in zip(pts, pts[1:]):
        if t0 <= tokens <= t1:
            return u0 if t1 == t0 else u0 + (u1 - u0) * (tokens - t0) / (t1 - t0)
    return pts[0][1]


def pick(candidates: list[str], recipe: str, world: int, tokens: int,
         table: dict | None) -> tuple[str, str] | None:
    """-> (backend, one-line reason) of the fastest measured candidate, or None."""
    if not table or int(table.get("world", 0)) != world:
        return None
    timed = []
    for name in candidates:
        points = table.get("entries", {}).get(name, {}).get(recipe)
        us = _time_at(points or [], tokens)
        if us is not None:
            timed.append((us, name))
    if not timed:
        return None
    timed.sort()
    others = ", ".join(f"{n} {us:.0f} us" for us, n in timed[1:])
    src = table.get("measured", "measured table")
    return timed[0][1], (f"auto: {timed[0][1]} ({tokens} tokens/rank, {recipe}: "
                         f"{timed[0][0]:.0f} us dispatch+combine" +
                         (f" vs {others}" if others else "") + f"; {src})")


__all__ = ["load_table", "pick", "TABLE"]
