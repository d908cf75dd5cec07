"""What the launcher prints while it runs: one line per phase on stderr with the time since the
launch began, and a step bar on a terminal. Plain text (no ANSI codes) when stderr is not a
terminal; nothing with --quiet."""

from __future__ import annotations

import time


def stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


class Phases:
    """`phases("starting 4 ranks")` prints `[   3.1 s] starting 4 ranks`."""

    def __init__(self, quiet: bool = False, console=None):
        self.quiet = quiet
        self.console = console
        self.t0 = time.monotonic()

    def __call__(self, text: str) -> None:
        if self.quiet:
            return
        if self.console is None:
            self.console = stderr_console()
        self.console.print(f"[{time.monotonic() - self.t0:7.1f} s] {text}", markup=False)

    def counter(self, text: str, every_s: float = 5.0):
        """A callback (done, total) that prints `text: done/total` at most every every_s
        seconds while a long phase goes on (nothing for one that ends sooner)."""
        last = [time.monotonic()]

        def tick(done: int, total: int) -> None:
            now = time.monotonic()
            if done < total and now - last[0] >= every_s:
                last[0] = now
                self(f"{text}: {done}/{total}")
        return tick

    def steps(self, total: int):
        """A transient step bar on a terminal (None otherwise: the phase line is enough)."""
        if self.quiet:
            return None
        if self.console is None:
            self.console = stderr_console()
        if not self.console.is_terminal:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        from rich.progress import TimeElapsedColumn

        p = Progress(TextColumn("[bold]steps"), BarColumn(), MofNCompleteColumn(),
                     TimeElapsedColumn(), transient=True, console=self.console)
        p.start()
        p.add_task("steps", total=total)
        return p
