"""``adaserve usage``: read the usage ledger offline (no server needed): totals by
tenant, class and day or hour, the request rows, refusals, or the per-class audit of
a window, as CSV or JSON on stdout."""

from __future__ import annotations

import argparse
import csv
import json
import sys

from adaserve.ledger import query
from adaserve.ledger.config import UsageConfig, UsageConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--db",
        metavar="URL",
        help="the ledger: a SQLite path (or sqlite:////abs/path.db) or a postgresql:// URL "
        "(default: usage.db in $ADASERVE_DATA, else $XDG_DATA_HOME/adaserve)",
    )
    p.add_argument(
        "--since", help="from this time: epoch seconds, ISO 8601 (UTC), or -N[dhm] (ago)"
    )
    p.add_argument("--until", help="up to this time (same forms)")
    p.add_argument("--tenant", help="one tenant only")
    p.add_argument("--slo-class", help="one SLO class only")
    p.add_argument("--group-by", choices=sorted(query.GRANULARITY), default="day")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--requests", action="store_true", help="the request rows, not totals")
    what.add_argument("--refusals", action="store_true", help="refusals by tenant, class, reason")
    what.add_argument(
        "--report", action="store_true", help="the per-class audit report of the window (JSON)"
    )
    p.add_argument("--format", choices=["csv", "json"], default="csv")


def _fail(msg: str) -> int:
    print(f"adaserve usage: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    try:
        since = query.parse_time(args.since) if args.since else None
        until = query.parse_time(args.until) if args.until else None
        cfg = UsageConfig(db=args.db)
    except (ValueError, UsageConfigError) as e:
        return _fail(str(e))
    if not cfg.enabled:
        return _fail("--db none: there is no ledger to read")
    kind, where = cfg.target()
    if kind == "sqlite":
        from pathlib import Path

        if not Path(where).exists():
            return _fail(f"no usage ledger at {where}")
    from adaserve.ledger.ledger import open_store

    try:
        store = open_store(cfg)
    except Exception as e:
        return _fail(f"cannot open {where if kind == 'sqlite' else 'the database'}: {e}")
    try:
        if args.report:
            rep = query.class_report(store, since, until, args.tenant)
            json.dump(rep, sys.stdout, indent=1, sort_keys=True)
            print()
            return 0
        if args.requests:
            rows, after = [], None
            while True:
                page, more = query.list_requests(
                    store, tenant=args.tenant, cls=args.slo_class, since=since, until=until,
                    after=after, limit=query.MAX_PAGE,
                )  # fmt: skip
                rows += page
                if not more:
                    break
                after = page[-1]["id"]
        elif args.refusals:
            rows = query.refusal_counts(store, since, until, args.tenant)
        else:
            rows = query.usage_totals(
                store, since, until, args.group_by, args.tenant, args.slo_class
            )
    finally:
        store.close()
    if args.format == "json":
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    if rows:
        w = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    return 0
