"""The local spool: ledger items that could not reach the database, one JSON line
each, appended and fsync'ed before the response that made them is finished. Replayed
in file order once the database is back; every item has a unique id, so a replay
that is interrupted and run again stores nothing twice. A line cut short by a crash
mid-append (the response it belonged to had not been finished) is skipped."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from adaserve.ledger.rows import Refusal, UsageRow, from_line, to_line

log = logging.getLogger("adaserve.ledger")


class Spool:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def append(self, items: Iterable[UsageRow | Refusal]) -> int:
        """Append and fsync; returns how many were written."""
        lines = [to_line(it) + "\n" for it in items]
        if not lines:
            return 0
        data = "".join(lines).encode("utf-8")
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        return len(lines)

    def __len__(self) -> int:
        with self._lock, contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
            return sum(1 for _ in f)
        return 0

    def items(self) -> Iterator[UsageRow | Refusal]:
        """Every readable item, in the order appended."""
        with self._lock:
            try:
                text = self.path.read_text(encoding="utf-8", errors="replace")
            except FileNotFoundError:
                return iter(())
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                out.append(from_line(line))
            except (ValueError, TypeError, KeyError):
                log.warning("usage spool %s: line %d is not a record; skipped", self.path, n)
        return iter(out)

    def clear(self) -> None:
        """Remove the file (everything in it is in the database)."""
        with self._lock, contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
            _fsync_dir(self.path.parent)


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
