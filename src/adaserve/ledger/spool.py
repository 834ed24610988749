"""The local spool: ledger items that could not reach the database, one JSON line
each, appended and fsync'ed before the response that made them is finished. Replayed
in file order once the database is back; every item has a unique id, so a replay
that is interrupted and run again stores nothing twice. A line cut short by a crash
mid-append (the response it belonged to had not been finished) is skipped.

Several servers may share one spool path (replicas on one machine, one PostgreSQL):
each claims a slot, the path itself or ``name.1.jsonl``, ``name.2.jsonl``..., by an
exclusive ``flock`` on a ``.lock`` file beside it, held for the life of the process
(the kernel drops it when the process dies, ``kill -9`` included). A server that
starts later claims the first free slot and replays what a dead one left there."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from adaserve.ledger.rows import Refusal, UsageRow, from_line, to_line

log = logging.getLogger("adaserve.ledger")


MAX_SLOTS = 256


def _claim(base: Path) -> tuple[Path, int]:
    """The first slot of ``base`` no live process holds, and its lock's descriptor."""
    for n in range(MAX_SLOTS):
        p = base if n == 0 else base.with_name(f"{base.stem}.{n}{base.suffix}")
        fd = os.open(p.with_name(p.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        return p, fd
    raise RuntimeError(f"usage spool {base}: all {MAX_SLOTS} slots are held by live servers")


class Spool:
    def __init__(self, path: str | Path):
        base = Path(path)
        base.parent.mkdir(parents=True, exist_ok=True)
        self.path, self._lock_fd = _claim(base)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Give the slot up (what is in it stays, for the next server to replay)."""
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

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
