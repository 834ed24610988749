"""The ``[usage]`` table of the server's TOML (and ``--usage-db``): where the ledger
lives, how long its rows are kept, where the spool and the daily reports go."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from adaserve.util import paths

NONE = "none"
DB_FILE = "usage.db"
SPOOL_FILE = "usage-spool.jsonl"


class UsageConfigError(ValueError):
    """A ``[usage]`` value is invalid (the message names it)."""


@dataclass(frozen=True)
class UsageConfig:
    """db:               None: a SQLite file in the data folder (``$ADASERVE_DATA``, else
                         ``$XDG_DATA_HOME/adaserve``); ``none``: no ledger (in memory, as
                         before: lost on restart); a path or ``sqlite:///path``; or a
                         ``postgresql://`` URL
    keep_days:           request and refusal rows older than this are deleted (hourly
                         totals are kept); None: kept for ever
    spool:               the spool file (default: beside the SQLite file, or in the data
                         folder for PostgreSQL)
    report_dir:          write yesterday's per-class report there as JSON once a day
                         (``slo-report-YYYY-MM-DD.json``); None: no report files
    commit_timeout_s:    a response waits at most this long for its row (then it is
                         finished anyway and the wait is logged)
    replica:             the name rows are stamped with (default: host:pid)
    budget_refresh_s:    the budgets are read again from the database this often (what
                         other servers on it, replicas, have spent)
    sqlite_synchronous:  ``normal`` (default, WAL mode): a committed row survives kill -9
                         (the OS holds it) but a power cut may lose the last commits;
                         ``full``: every commit is fsync'ed, so it survives a power cut
                         too (a few ms more per commit)
    """

    db: str | None = None
    keep_days: float | None = None
    spool: str | None = None
    report_dir: str | None = None
    commit_timeout_s: float = 10.0
    replica: str | None = None
    sqlite_synchronous: str = "normal"
    budget_refresh_s: float = 2.0

    def __post_init__(self) -> None:
        v = self.budget_refresh_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise UsageConfigError("usage.budget_refresh_s must be a positive number of seconds")
        if self.sqlite_synchronous not in ("full", "normal"):
            raise UsageConfigError("usage.sqlite_synchronous must be 'full' or 'normal'")
        if self.db is not None and (not isinstance(self.db, str) or not self.db.strip()):
            raise UsageConfigError("usage.db must be a path, a URL or 'none'")
        days = self.keep_days
        if days is not None and (
            isinstance(days, bool) or not isinstance(days, (int, float)) or not 0 < days < math.inf
        ):
            raise UsageConfigError("usage.keep_days must be a positive number of days")
        v = self.commit_timeout_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise UsageConfigError("usage.commit_timeout_s must be a positive number of seconds")
        for k in ("spool", "report_dir", "replica"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise UsageConfigError(f"usage.{k} must be a non-empty string")
        if self.db is not None:
            kind_of(self.db)  # raises on an unknown scheme

    @property
    def enabled(self) -> bool:
        return self.db is None or self.db.strip().lower() != NONE

    def target(self) -> tuple[str, str]:
        """("sqlite", path) or ("postgresql", url)."""
        if self.db is None:
            return "sqlite", str(paths.data_root() / DB_FILE)
        return kind_of(self.db)

    def spool_path(self) -> Path:
        if self.spool is not None:
            return Path(self.spool)
        kind, where = self.target()
        if kind == "sqlite":
            return Path(where).with_name(Path(where).name + ".spool.jsonl")
        return paths.data_root() / SPOOL_FILE


def kind_of(db: str) -> tuple[str, str]:
    """("sqlite", path) or ("postgresql", url) of a ``usage.db`` value."""
    s = db.strip()
    low = s.lower()
    if low.startswith(("postgresql://", "postgres://")):
        return "postgresql", s
    if low.startswith("sqlite:///"):
        # SQLAlchemy's form: sqlite:///relative.db, sqlite:////absolute/path.db
        return "sqlite", str(Path(s[len("sqlite:///") :]).expanduser())
    if low.startswith("sqlite://"):
        raise UsageConfigError(
            "usage.db: a SQLite URL is sqlite:///relative.db or sqlite:////absolute/path.db"
        )
    if "://" in s:
        raise UsageConfigError(
            f"usage.db: unknown scheme {s.split('://')[0]!r} (a path, sqlite:///path, "
            "postgresql://... or 'none')"
        )
    if low == NONE:
        return NONE, ""
    return "sqlite", str(Path(s).expanduser())
