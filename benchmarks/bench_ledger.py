"""Issue 37's goals for the usage ledger, three measurements:

    python benchmarks/bench_ledger.py latency [--rows 2000] [--pg URL]
    python benchmarks/bench_ledger.py kill [--rounds 10] [--db URL] [--model DIR]
    python benchmarks/bench_ledger.py rows [--rows 10000000] [--db FILE]

- ``latency``: the real writer on a real SQLite file (``synchronous`` FULL and NORMAL)
  and, with ``--pg``, PostgreSQL. What a response waits for its own row (submit to
  commit), one request at a time and in bursts of 200; the CPU the ledger spends per
  row (process CPU time over rows: submit, batching, SQL, commit); the engine-thread
  part (completing a row and queueing it).
- ``kill``: ``adaserve serve`` (the shipped pair unless ``--model``) as its own
  process, 4 clients streaming completions, ``kill -9`` once responses are completing
  and others are in flight, restart on the same database, ``--rounds`` times. Every
  response received in full must have exactly one row with the client's token counts
  (lost: none; doubled: the hourly totals count each stored row once).
- ``rows``: ``--rows`` synthetic rows over 30 days (5 tenants, 3 classes) in a SQLite
  ledger, then the time of a per-class daily report of the month (the hourly roll-up),
  the same report straight from the request rows, a usage-by-day query, and one day's
  full per-class audit (percentiles from that day's rows).

Prints one JSON object per measurement (``--out`` writes them too).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from adaserve.ledger import UsageConfig, UsageRow, open_store  # noqa: E402
from adaserve.ledger.query import (  # noqa: E402
    class_report,
    daily_class_report,
    list_requests,
    usage_totals,
)
from adaserve.ledger.spool import Spool  # noqa: E402
from adaserve.ledger.writer import LedgerWriter  # noqa: E402


def pct(xs, q):
    xs = sorted(xs)
    return xs[max(0, int(round(q / 100 * len(xs))) - 1)] if xs else None


def _row(i: int, now: float) -> UsageRow:
    return UsageRow(
        id=f"bench-{i}-{random.getrandbits(48):x}", tenant=f"t{i % 5}", key_id="0123456789ab",
        class_asked="chat", cls="chat", prompt_tokens=120, completion_tokens=64, charge=0.064,
        ttft_ms=80.0, tpot_ms=25.0, slo_met=True, finish_reason="stop", arrival=now - 2,
        finished=now, replica="bench",
    )  # fmt: skip


# ---------------------------------------------------------------------- latency


def _writer_latency(store, n: int, burst: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="ledger-bench-"))
    w = LedgerWriter(store, Spool(tmp / "spool.jsonl"))
    waits = []
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(n):  # one at a time: each response waits for its own commit
        s = time.perf_counter()
        w.submit(_row(i, time.time())).result()
        waits.append(time.perf_counter() - s)
    seq_cpu = (time.process_time() - cpu0) / n
    seq_wall = (time.perf_counter() - t0) / n
    bwaits = []
    for b in range(max(1, n // burst)):  # bursts: many finish at once
        s = time.perf_counter()
        futs = [w.submit(_row(n + b * burst + i, time.time())) for i in range(burst)]
        for f in futs:
            f.result()
            bwaits.append(time.perf_counter() - s)
    # CPU per row under load: a stream of rows as fast as the writer takes them
    cpu0 = time.process_time()
    futs = [w.submit(_row(10 * n + i, time.time())) for i in range(n)]
    for f in futs:
        f.result()
    load_cpu = (time.process_time() - cpu0) / n
    w.close()
    assert w.stats.spooled == 0
    return {
        "sequential_wait_ms": {
            "p50": 1e3 * statistics.median(waits), "p99": 1e3 * pct(waits, 99),
            "max": 1e3 * max(waits),
        },
        "burst": burst,
        "burst_wait_ms": {"p50": 1e3 * statistics.median(bwaits), "p99": 1e3 * pct(bwaits, 99)},
        "cpu_ms_per_row_sequential": 1e3 * seq_cpu,
        "wall_ms_per_row_sequential": 1e3 * seq_wall,
        "cpu_ms_per_row_streamed": 1e3 * load_cpu,
        "commits": w.stats.batches,
    }  # fmt: skip


def _engine_thread_cost(n: int = 20000) -> dict:
    """The engine thread's part: complete a row (``RowAcc.add``) and queue it."""
    from adaserve.server.accounting import RowAcc

    class _Null:
        def submit(self, item):
            return None

    null = _Null()
    t0 = time.perf_counter()
    for i in range(n):
        acc = RowAcc(f"x{i}", "t", "k", "chat", "r")
        acc.arm(1)
        part = ("chat", 100, 64, 0.06, 80.0, 25.0, True, "stop", time.time() - 1, time.time())
        _, row = acc.add(0, part)
        null.submit(row)
    return {"engine_thread_us_per_request": 1e6 * (time.perf_counter() - t0) / n}


def cmd_latency(args) -> list[dict]:
    out = []
    for sync in ("full", "normal"):
        d = Path(tempfile.mkdtemp(prefix="ledger-bench-"))
        store = open_store(UsageConfig(db=str(d / "usage.db"), sqlite_synchronous=sync))
        r = {"measure": "latency", "backend": f"sqlite synchronous={sync}"}
        r.update(_writer_latency(store, args.rows, 200))
        store.close()
        out.append(r)
    if args.pg:
        store = open_store(UsageConfig(db=args.pg))
        r = {"measure": "latency", "backend": "postgresql"}
        r.update(_writer_latency(store, args.rows, 200))
        store.close()
        out.append(r)
    out.append({"measure": "engine_thread", **_engine_thread_cost()})
    return out


# ---------------------------------------------------------------------- kill -9


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _traffic(url, key, stop, done, lock, i):
    import httpx

    with httpx.Client(base_url=url, timeout=120) as h:
        n = 0
        while not stop.is_set():
            n += 1
            body = {
                "model": "m", "prompt": f"client {i} request {n}: once upon a time",
                "max_tokens": 4 + (n % 5), "stream": True,
                "stream_options": {"include_usage": True},
            }  # fmt: skip
            rid, usage, fin = None, None, False
            try:
                with h.stream(
                    "POST", "/v1/completions", json=body,
                    headers={"Authorization": f"Bearer {key}"},
                ) as r:  # fmt: skip
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            fin = True
                        elif line.startswith("data: {"):
                            d = json.loads(line[6:])
                            rid = d.get("id", rid)
                            usage = d.get("usage") or usage
            except Exception:
                return
            if fin:
                with lock:
                    done.append((rid, usage["prompt_tokens"], usage["completion_tokens"]))


def cmd_kill(args) -> list[dict]:
    from adaserve.bench.demo import wait_healthy

    tmp = Path(tempfile.mkdtemp(prefix="ledger-kill-"))
    db = args.db or str(tmp / "usage.db")
    key = "sk-bench-ledger-key"
    conf = tmp / "server.toml"
    conf.write_text(
        f'[server]\nmodel_name = "m"\nadmission = false\nlog_stats = false\n'
        f'[tenants.bench]\nkeys = ["{key}"]\n'
        f"[usage]\ndb = {json.dumps(db)}\nspool = {json.dumps(str(tmp / 'spool.jsonl'))}\n"
        + (f'sqlite_synchronous = "{args.sqlite_synchronous}"\n' if not args.db else "")
    )
    received, lock = [], threading.Lock()
    per_round = []
    waits: dict[str, dict] = {}
    for rnd in range(args.rounds):
        port = _free_port()
        argv = [sys.executable, "-m", "adaserve", "serve", "--port", str(port)]
        argv += ["--config", str(conf), "--policy", args.policy]
        if args.model:
            argv += ["--model", args.model, "--no-draft"]
        log = (tmp / f"server{rnd}.log").open("w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", p, 600)
            stop = threading.Event()
            before = len(received)
            ts = [
                threading.Thread(
                    target=_traffic,
                    args=(f"http://127.0.0.1:{port}", key, stop, received, lock, i),
                    daemon=True,
                )
                for i in range(args.clients)
            ]
            for t in ts:
                t.start()
            t0 = time.monotonic()
            want = before + args.per_round + random.randint(0, 3)
            while len(received) < want and time.monotonic() - t0 < 600:
                time.sleep(0.005)
            time.sleep(random.uniform(0, 0.5))  # a random moment: mid-step, mid-commit
            _add_waits(f"http://127.0.0.1:{port}", waits)
            os.kill(p.pid, signal.SIGKILL)
            p.wait(30)
            stop.set()
            for t in ts:
                t.join(120)
            per_round.append(len(received) - before)
        finally:
            if p.poll() is None:
                p.kill()
            log.close()
        print(f"round {rnd + 1}: {per_round[-1]} responses received in full", file=sys.stderr)
    store = open_store(UsageConfig(db=db))
    rows, after = {}, None
    doubled_rows = 0
    while True:
        page, more = list_requests(store, after=after, limit=1000)
        for r in page:
            doubled_rows += r["id"] in rows
            rows[r["id"]] = r
        if not more:
            break
        after = page[-1]["id"]
    lost = [rid for rid, _, _ in received if rid not in rows]
    wrong = [
        rid
        for rid, pt, ct in received
        if rid in rows and (rows[rid]["prompt_tokens"], rows[rid]["completion_tokens"]) != (pt, ct)
    ]
    tot = sum(b["requests"] for b in usage_totals(store))
    store.close()
    return [
        {
            "measure": "kill9",
            "db": "postgresql" if db.startswith("postgres") else "sqlite",
            "rounds": args.rounds,
            "received_in_full": len(received),
            "per_round": per_round,
            "rows": len(rows),
            "rows_of_partial_responses": len(rows) - (len(received) - len(lost)),
            "lost": len(lost),
            "wrong_counts": len(wrong),
            "doubled_rows": doubled_rows,
            "doubled_in_totals": tot - len(rows),
            "ledger_wait": _wait_summary(waits.get("wait", {})),
            "ledger_commit": _wait_summary(waits.get("commit", {})),
        }
    ]


def _add_waits(url: str, into: dict) -> None:
    """Add the server's ``adaserve:usage_ledger_{wait,commit}_seconds`` buckets."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for name in ("wait", "commit"):
            if fam.name == f"adaserve:usage_ledger_{name}_seconds":
                d = into.setdefault(name, {})
                for smp in fam.samples:
                    if smp.name.endswith("_bucket"):
                        le = float(smp.labels["le"])
                        d[le] = d.get(le, 0) + smp.value


def _wait_summary(buckets: dict) -> dict:
    """From cumulative buckets: responses, the share that waited <= 1 ms, and the
    bucket bound under which 99% waited."""
    if not buckets:
        return {}
    total = buckets[float("inf")]
    p99 = next(le for le in sorted(buckets) if buckets[le] >= 0.99 * total)
    return {
        "responses": total,
        "share_within_1ms": buckets.get(0.001, 0) / total if total else None,
        "p99_at_most_ms": 1e3 * p99,
        "p50_at_most_ms": 1e3 * next(le for le in sorted(buckets) if buckets[le] >= 0.5 * total),
    }


# ---------------------------------------------------------------------- 10M rows


def cmd_rows(args) -> list[dict]:
    path = Path(args.db or tempfile.mkdtemp(prefix="ledger-rows-") + "/usage.db")
    fresh = not path.exists()
    store = open_store(UsageConfig(db=str(path)))
    store.close()
    build_s = None
    if fresh:
        t0 = time.perf_counter()
        c = sqlite3.connect(path)
        c.execute("PRAGMA journal_mode=WAL")
        c.execute("PRAGMA synchronous=OFF")  # the synthetic load only
        end = int(time.time() // 86400) * 86400
        start = end - 30 * 86400
        rng = random.Random(0)
        classes = ("interactive", "chat", "batch")
        step = 30 * 86400 / args.rows
        batch = []
        ins = (
            "INSERT INTO requests (id, tenant, key_id, class_asked, class, prompt_tokens, "
            "completion_tokens, charge, ttft_ms, tpot_ms, slo_met, finish_reason, arrival, "
            "finished, hour, replica, choices) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
        )
        for i in range(args.rows):
            fin = start + i * step
            cls = classes[i % 3]
            ct = rng.randint(1, 256)
            batch.append(
                (f"cmpl-{i:012x}", f"tenant{i % 5}", "0123456789ab", cls, cls,
                 rng.randint(8, 512), ct, ct * 0.001, rng.uniform(20, 400),
                 rng.uniform(5, 60), int(rng.random() < 0.9), "stop", fin - 1.0, fin,
                 int(fin // 3600), "bench", 1)
            )  # fmt: skip
            if len(batch) == 100_000:
                c.executemany(ins, batch)
                c.commit()
                batch.clear()
        if batch:
            c.executemany(ins, batch)
            c.commit()
        # the roll-up the writer keeps in step, built once for the synthetic rows
        c.execute(
            "INSERT INTO usage_hourly SELECT hour, tenant, class, COUNT(*), SUM(prompt_tokens), "
            "SUM(completion_tokens), SUM(charge), SUM(slo_met), "
            "SUM(CASE WHEN class <> class_asked THEN 1 ELSE 0 END), "
            "SUM(CASE WHEN finish_reason IN ('stop', 'length') THEN 0 ELSE 1 END) "
            "FROM requests GROUP BY hour, tenant, class"
        )
        c.commit()
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        c.close()
        build_s = time.perf_counter() - t0
    store = open_store(UsageConfig(db=str(path)))
    n = store.query("SELECT COUNT(*) FROM requests")[0][0]

    def timed(fn, *a, **kw):
        t0 = time.perf_counter()
        r = fn(*a, **kw)
        return time.perf_counter() - t0, r

    out = {"measure": "rows", "rows": n, "db_bytes": path.stat().st_size, "build_s": build_s}
    out["daily_class_report_s"], rep = timed(daily_class_report, store)
    out["daily_class_report_rows"] = len(rep)
    out["usage_by_day_s"], _ = timed(usage_totals, store, None, None, "day")
    out["raw_rows_daily_class_report_s"], _ = timed(
        store.query,
        "SELECT hour / 24, class, COUNT(*), SUM(slo_met), SUM(completion_tokens), SUM(charge) "
        "FROM requests GROUP BY hour / 24, class",
    )
    day0 = int(time.time() // 86400) * 86400 - 86400
    out["one_day_audit_report_s"], _ = timed(class_report, store, day0, day0 + 86400)
    out["one_page_of_rows_s"], _ = timed(
        list_requests, store, tenant="tenant3", since=day0, limit=100
    )
    store.close()
    return [out]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("latency")
    la.add_argument("--rows", type=int, default=2000)
    la.add_argument("--pg", help="also a PostgreSQL database URL")
    ki = sub.add_parser("kill")
    ki.add_argument("--rounds", type=int, default=10)
    ki.add_argument("--db", help="the ledger (default: a fresh SQLite file)")
    ki.add_argument("--model", help="a checkpoint to serve (default: the shipped pair)")
    ki.add_argument("--policy", default="ar")
    ki.add_argument("--clients", type=int, default=4)
    ki.add_argument("--per-round", type=int, default=8, help="responses before the kill")
    ki.add_argument("--sqlite-synchronous", choices=["full", "normal"], default="normal")
    ro = sub.add_parser("rows")
    ro.add_argument("--rows", type=int, default=10_000_000)
    ro.add_argument("--db", help="a SQLite file (built when missing, reused when present)")
    for sp in (la, ki, ro):
        sp.add_argument("--out", help="append the JSON results to this file")
    args = p.parse_args()
    res = {"latency": cmd_latency, "kill": cmd_kill, "rows": cmd_rows}[args.cmd](args)
    for r in res:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "a") as f:
            for r in res:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
