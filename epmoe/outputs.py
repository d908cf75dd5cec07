"""Output paths checked before a command starts: a file or folder it cannot write is an exit
2 with the path and the fix, not a traceback after minutes of measuring.

    p.add_argument("--json", type=writable_file)   # argparse: exit 2, "argument --json: ..."
    why = file_problem(path)                       # the same rule where no parser runs

and a command whose reader goes away (`... | head`) ends quietly: `run_main(main)`.
`json_text(obj)` is the JSON a command prints or writes: standard JSON, a figure that is not
a finite number (a failed probe's NaN) as null, never the NaN / Infinity tokens that strict
parsers refuse.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path


def json_text(obj, indent: int | None = 1) -> str:
    """obj as standard JSON (non-finite floats -> null)."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False)


def dump_json(obj, f, indent: int | None = 1) -> None:
    """`json.dump` as `json_text` writes it (standard JSON, non-finite floats -> null)."""
    f.write(json_text(obj, indent))


def _finite(o):
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def file_problem(path: str) -> str | None:
    """Why `path` cannot be written as a file (None: it can)."""
    p = Path(path)
    if p.is_dir():
        return f"{path} is a folder; give a file name"
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        return f"{path}: folder {str(parent)!r} does not exist; create it or pick another path"
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        return f"{path} is not writable; pick another path"
    existed = p.exists()
    try:  # the permission bits do not tell (root; /proc, read-only mounts): try it
        open(p, "a").close()  # appending truncates nothing
    except OSError as e:
        return f"{path} cannot be written ({e.strerror}); pick another path"
    finally:
        if not existed and p.exists():
            p.unlink()
    return None


def dir_problem(path: str) -> str | None:
    """Why `path` cannot be (created and) written as a folder (None: it can)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        return f"{path} is a file; give a folder"
    q = p
    while not q.exists():
        q = q.parent
    if not q.is_dir():
        return f"{path}: {str(q)!r} is a file, not a folder; pick another folder"
    if not os.access(q, os.W_OK | os.X_OK):
        return f"{path}: {str(q)!r} is not writable; pick another folder"
    made = []  # the permission bits do not tell (root; /proc, read-only mounts): try it
    try:
        for d in reversed([p, *p.parents]):
            if not d.exists():
                d.mkdir()
                made.append(d)
        tempfile.TemporaryFile(dir=p).close()
    except OSError as e:
        return f"{path} cannot be written ({e.strerror}); pick another folder"
    finally:
        for d in reversed(made):
            d.rmdir()
    return None


def writable_file(path: str) -> str:
    """argparse type: a file this command can write."""
    why = file_problem(path)
    if why:
        raise argparse.ArgumentTypeError(why)
    return path


def writable_dir(path: str) -> str:
    """argparse type: a folder this command can create or write into."""
    why = dir_problem(path)
    if why:
        raise argparse.ArgumentTypeError(why)
    return path


def run_main(main, *args) -> None:
    """sys.exit(main(*args)); a closed stdout (`| head`) is exit 141 (as SIGPIPE), no
    traceback: stdout goes to /dev/null so the interpreter's last flush cannot raise again."""
    try:
        code = main(*args)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    sys.exit(code)
