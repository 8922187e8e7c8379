"""Progress bars on stderr: a live bar on a terminal, a line per 10 % (or per minute) in a log."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any, Protocol


class Bar(Protocol):
    def update(self, n: int) -> Any: ...


class _NoBar:
    def update(self, n: int) -> None:
        pass


class _LineBar:
    """Progress for a non-terminal stderr (logs): one line per 10% or per minute, with an estimate."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0
        self.t0 = self.last = time.monotonic()
        self.last_pct = 0

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        pct = 100 * self.done // max(1, self.total)
        if pct >= self.last_pct + 10 or now - self.last >= 60 or self.done == self.total:
            eta = (now - self.t0) / max(1, self.done) * (self.total - self.done)
            print(f"{self.label}: {self.done}/{self.total} ({pct}%), {now - self.t0:.0f} s, "
                  f"~{eta:.0f} s left", file=sys.stderr, flush=True)
            self.last, self.last_pct = now, pct


class progress:  # noqa: N801 (a context manager used like a function)
    """``with progress(total, label, show) as bar: bar.update(n)``; ``total`` 0 = unknown."""

    def __init__(self, total: int, label: str, show: bool = True) -> None:
        self.total, self.label, self.show = total, label, show
        self._bar: Any = None

    def __enter__(self) -> Bar:
        if not self.show:
            return _NoBar()
        if not sys.stderr.isatty():
            return _LineBar(self.total, self.label) if self.total else _NoBar()
        from tqdm import tqdm  # noqa: PLC0415 (only a terminal needs it)

        self._bar = tqdm(total=self.total or None, desc=self.label, file=sys.stderr, unit_scale=True)
        return self._bar  # type: ignore[no-any-return]

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.close()
