"""How the CLI shows things: rich tables, progress bars and errors on a terminal, plain lines elsewhere.

On a terminal, rich draws (colour, box tables, a live progress bar). Anywhere else (a pipe, a
log file, systemd, CI) every line is plain text with no escape codes, and progress is one line
per change, so that logs read top to bottom and `grep` finds what it looks for.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

# What a progress context hands back: update(done, status).
ProgressUpdate = Callable[[int, str], None]


def plain_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns two spaces apart, a dashed rule under the header, ``-`` for None."""
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Output:
    """The CLI's stdout and stderr. ``terminal`` (default: whether stdout is a TTY) picks rich
    or plain; tests pass their own streams and force either mode."""

    def __init__(
        self, out: TextIO | None = None, err: TextIO | None = None, terminal: bool | None = None
    ) -> None:
        # Looked up now, not at import: pytest's capsys swaps sys.stdout per test.
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.terminal = _isatty(self.out) if terminal is None else terminal
        err_terminal = _isatty(self.err) if terminal is None else terminal
        self._console = (
            Console(file=self.out, force_terminal=True, highlight=False) if self.terminal else None
        )
        self._err_console = (
            Console(file=self.err, force_terminal=True, highlight=False) if err_terminal else None
        )

    def say(self, text: str) -> None:
        """One message line (or several), flushed at once: `up` runs for hours under a supervisor."""
        if self._console is not None:
            self._console.print(Text(text), soft_wrap=True)
        else:
            print(text, file=self.out, flush=True)

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        if self._console is None:
            print(plain_table(headers, rows), file=self.out, flush=True)
            return
        table = Table(*headers, header_style="bold", show_edge=False, pad_edge=False)
        for row in rows:
            table.add_row(*("-" if c is None else str(c) for c in row))
        self._console.print(table)

    def error(self, message: str) -> None:
        """``tail-ray: message`` on stderr; red on a terminal. The message is never read as markup."""
        if self._err_console is not None:
            self._err_console.print(Text.assemble(("tail-ray: ", "bold red"), message), soft_wrap=True)
        else:
            print(f"tail-ray: {message}", file=self.err, flush=True)

    @contextmanager
    def progress(self, label: str, total: int) -> Iterator[ProgressUpdate]:
        """A progress display for ``total`` units of work; the caller reports (done, status)."""
        if self._console is None:
            yield _plain_progress(self.out, label, total)
            return
        columns = (
            TextColumn("{task.description:>5}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=self._console) as bar:
            task = bar.add_task(label, total=total, status="")

            def update(done: int, status: str) -> None:
                bar.update(task, completed=done, status=status)

            yield update


def _plain_progress(out: TextIO, label: str, total: int) -> ProgressUpdate:
    last: list[tuple[int, str]] = []

    def update(done: int, status: str) -> None:
        if last and last[-1] == (done, status):
            return  # a line per change: a poll that saw nothing new prints nothing
        last[:] = [(done, status)]
        print(f"{label}: {done}/{total} steps, {status}", file=out, flush=True)

    return update


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False
