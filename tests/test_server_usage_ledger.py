"""The durable usage ledger end to end, on SQLite and on a real PostgreSQL server (the
same tests, parametrized): one row per response with the token counts the client saw,
committed before the response's last byte; 200 concurrent requests give 200 rows;
refusals counted; tenant isolation on both usage endpoints; budgets that survive a
restart; a past window's per-class report; the database down and back (spool replay,
nothing lost or doubled); ``kill -9`` mid-traffic, in rounds."""

from __future__ import annotations

import asyncio
import calendar
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from pg_fixtures import PgServer, why_no_postgres
from server_fixtures import LiveServer, engine_config, scrape, server_test_env, templated_target

from adaserve.ledger import UsageConfig, open_store
from adaserve.ledger.query import list_requests, usage_totals
from adaserve.server import parse_config
from adaserve.server.config import tomllib

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)

ACME, OTHER, CAPPED, TOKCAP, OPS = (
    "sk-acme-ledger",
    "sk-other-ledger",
    "sk-capped-ledger",
    "sk-tokcap-ledger",
    "sk-ops-ledger",
)
CONFIG = """
[server]
model_name = "tiny"
admission = false
log_stats = false
step_delay_s = 0.005  # every step lasts 5 ms at least: a 480-token stream, 2.4 s

[tenants.acme]
keys = ["sk-acme-ledger"]
classes = ["chat", "batch"]

[tenants.other]
keys = ["sk-other-ledger"]

[tenants.capped]
keys = ["sk-capped-ledger"]
requests_per_day = 3

[tenants.tokcap]
keys = ["sk-tokcap-ledger"]
tokens_per_day = 30

[tenants.down]
keys = ["sk-down-ledger"]
classes = ["batch"]
on_forbidden_class = "downgrade"

[tenants.leak]
keys = ["sk-leak-ledger"]
requests_per_day = 2

[tenants.shared]
keys = ["sk-shared-ledger"]
requests_per_day = 4

[tenants.ops]
keys = ["sk-ops-ledger"]
admin = true

[usage]
"""


def server_config(db: str, spool: str | None = None, extra: str = ""):
    text = CONFIG + f"db = {json.dumps(db)}\n"
    if spool is not None:
        text += f"spool = {json.dumps(spool)}\n"
    return parse_config(tomllib.loads(text + extra))


@pytest.fixture(scope="module")
def pg():
    why = why_no_postgres()
    if why is not None:
        pytest.skip(why)
    s = PgServer()
    yield s
    s.close()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def db(request, tmp_path_factory):
    """A fresh ledger database: a SQLite file, or a database on the PostgreSQL server."""
    if request.param == "sqlite":
        return str(tmp_path_factory.mktemp("ledger") / "usage.db")
    return request.getfixturevalue("pg").new_database()


@pytest.fixture(scope="module")
def srv(db, tmp_path_factory):
    target = templated_target(tmp_path_factory)
    spool = str(tmp_path_factory.mktemp("spool") / "spool.jsonl")
    s = LiveServer(engine_config(target), server_config(db, spool))
    yield s
    s.stop()


def rows_of(srv, key=OPS, **params) -> list[dict]:
    """Every row /v1/usage/requests gives the key (following ``has_more``)."""
    out, after = [], None
    with srv.http() as h:
        while True:
            q = {"limit": 64, **params}
            if after:
                q["after"] = after
            r = h.get("/v1/usage/requests", params=q, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list"
            out += body["data"]
            if not body["has_more"]:
                return out
            after = body["last_id"]


def get(srv, path, key, **params) -> httpx.Response:
    with srv.http() as h:
        return h.get(path, params=params, headers={"Authorization": f"Bearer {key}"})


# ---------------------------------------------------------------------- rows


def test_each_response_has_one_row_with_the_counts_the_client_saw(srv):
    c = srv.client(ACME)
    seen = {}  # id -> (prompt, completion)
    r = c.completions.create(model="tiny", prompt="hello there", max_tokens=5)
    seen[r.id] = (r.usage.prompt_tokens, r.usage.completion_tokens)
    r = c.completions.create(model="tiny", prompt="two choices", max_tokens=4, n=2)
    seen[r.id] = (r.usage.prompt_tokens, r.usage.completion_tokens)
    r = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6
    )
    seen[r.id] = (r.usage.prompt_tokens, r.usage.completion_tokens)
    for kind in ("completion", "chat"):
        kw = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 7}
        if kind == "chat":
            chunks = list(
                c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "yo"}], **kw
                )
            )
        else:
            chunks = list(c.completions.create(model="tiny", prompt="stream me", **kw))
        u = chunks[-1].usage
        assert len({ch.id for ch in chunks}) == 1
        seen[chunks[0].id] = (u.prompt_tokens, u.completion_tokens)
    # read at once: each row was committed before its response's last byte
    rows = rows_of(srv, tenant="acme")
    by_id = {}
    for row in rows:
        assert row["id"] not in by_id, row["id"]
        by_id[row["id"]] = row
    key_id = hashlib.sha256(ACME.encode()).hexdigest()[:12]
    for rid, (pt, ct) in seen.items():
        row = by_id[rid]
        assert (row["prompt_tokens"], row["completion_tokens"]) == (pt, ct), row
        assert row["tenant"] == "acme" and row["key_id"] == key_id
        assert ACME not in json.dumps(row)
        assert row["slo_class"] == row["class_asked"] == "chat"
        assert row["finish_reason"] in ("stop", "length")
        assert row["arrival"] <= row["finished"] and row["replica"]
        assert row["ttft_ms"] is not None and row["charge"] >= 0
    assert by_id[[k for k in seen if k.startswith("cmpl-")][1]]["choices"] == 2
    # each response waited for its row (the wait is measured)
    waits = scrape(srv.url)["adaserve:usage_ledger_wait_seconds_count"]
    assert waits[0][1] >= len(seen)


def test_a_downgraded_request_is_billed_in_the_class_it_got(srv):
    r = srv.client("sk-down-ledger").completions.create(
        model="tiny", prompt="x", max_tokens=3, extra_body={"slo_class": "interactive"}
    )
    (row,) = [x for x in rows_of(srv, tenant="down") if x["id"] == r.id]
    assert (row["class_asked"], row["slo_class"]) == ("interactive", "batch")
    assert row["charge"] == pytest.approx(r.model_extra["metrics"]["charge"])
    u = get(srv, "/v1/usage", OPS, tenant="down").json()["data"]
    assert [(b["slo_class"], b["degraded"]) for b in u] == [("batch", 1)]
    rep = get(srv, "/v1/slo/report", OPS, since="-1h", tenant="down").json()
    assert rep["classes"]["interactive"]["degraded_out"] >= 1


def test_200_concurrent_requests_give_200_rows(srv):
    t0 = time.time()

    async def go():
        c = srv.async_client(OTHER, timeout=300)
        rs = await asyncio.gather(
            *(
                c.completions.create(model="tiny", prompt=f"request {i}", max_tokens=2)
                for i in range(200)
            )
        )
        await c.close()
        return rs

    rs = asyncio.run(go())
    want = {r.id: r.usage.completion_tokens for r in rs}
    assert len(want) == 200
    rows = rows_of(srv, tenant="other", since=str(t0 - 1))
    assert len(rows) == 200
    assert {r["id"]: r["completion_tokens"] for r in rows} == want
    # the totals agree with the rows
    u = get(srv, "/v1/usage", OPS, tenant="other", since=str(t0 - 1)).json()
    assert sum(b["requests"] for b in u["data"]) == 200
    assert sum(b["completion_tokens"] for b in u["data"]) == sum(want.values())


def test_an_aborted_stream_has_a_row_for_what_it_produced(srv):
    with srv.http() as h:
        body = {"model": "tiny", "prompt": "abort me", "max_tokens": 480, "stream": True}
        body["ignore_eos"] = True
        hdrs = {"Authorization": f"Bearer {ACME}"}
        got, rid = 0, None
        with h.stream("POST", "/v1/completions", json=body, headers=hdrs) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    d = json.loads(line[6:])
                    rid = d["id"]
                    got += 1
                    if got >= 3:
                        break
    from server_fixtures import wait_for

    row = wait_for(lambda: [x for x in rows_of(srv, tenant="acme") if x["id"] == rid], 60)
    assert row, "no row for the aborted stream"
    row = row[0]
    assert row["finish_reason"] == "client_disconnected"
    assert 1 <= row["completion_tokens"] < 480


# ---------------------------------------------------------------------- reading back


def test_tenant_isolation_on_both_usage_endpoints(srv):
    srv.client(OTHER).completions.create(model="tiny", prompt="mine", max_tokens=1)
    srv.client(ACME).completions.create(model="tiny", prompt="mine", max_tokens=1)
    for path in ("/v1/usage", "/v1/usage/requests"):
        own = get(srv, path, ACME)
        assert own.status_code == 200
        assert {b["tenant"] for b in own.json()["data"]} == {"acme"}
        r = get(srv, path, ACME, tenant="other")
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "tenant_not_allowed"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert get(srv, path, ACME, tenant="acme").status_code == 200
        everyone = {b["tenant"] for b in get(srv, path, OPS).json()["data"]}
        assert {"acme", "other"} <= everyone
        only = get(srv, path, OPS, tenant="other").json()["data"]
        assert only and {b["tenant"] for b in only} == {"other"}
        assert get(srv, path, "sk-wrong").status_code == 401


@pytest.mark.parametrize(
    "path,params,param",
    [
        ("/v1/usage", {"group_by": "week"}, "group_by"),
        ("/v1/usage", {"since": "yesterday-ish"}, "since"),
        ("/v1/usage", {"since": "100", "until": "50"}, "until"),
        ("/v1/usage", {"since": "1e300"}, "since"),
        ("/v1/usage/requests", {"until": "1e300"}, "until"),
        ("/v1/usage/requests", {"limit": "0"}, "limit"),
        ("/v1/usage/requests", {"limit": "many"}, "limit"),
        ("/v1/usage/requests", {"slo_met": "maybe"}, "slo_met"),
        ("/v1/slo/report", {"since": "nope"}, "since"),
    ],
)
def test_bad_usage_queries_are_400(srv, path, params, param):
    r = get(srv, path, OPS, **params)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_usage_by_hour_and_day_and_filters(srv):
    srv.client(ACME).completions.create(
        model="tiny", prompt="batch", max_tokens=2, extra_body={"slo_class": "batch"}
    )
    day = get(srv, "/v1/usage", OPS, tenant="acme").json()
    hour = get(srv, "/v1/usage", OPS, tenant="acme", group_by="hour").json()
    assert day["group_by"] == "day" and hour["group_by"] == "hour"
    for key in ("requests", "completion_tokens"):
        assert sum(b[key] for b in day["data"]) == sum(b[key] for b in hour["data"]) > 0
    assert all(b["start"] % 86400 == 0 for b in day["data"])
    assert all(b["start"] % 3600 == 0 for b in hour["data"])
    batch = get(srv, "/v1/usage", OPS, tenant="acme", slo_class="batch").json()["data"]
    assert batch and {b["slo_class"] for b in batch} == {"batch"}
    rows = rows_of(srv, tenant="acme", slo_class="batch")
    assert rows and sum(b["requests"] for b in batch) == len(rows)
    met = rows_of(srv, tenant="acme", slo_met="true")
    unmet = rows_of(srv, tenant="acme", slo_met="false")
    assert len(met) + len(unmet) == len(rows_of(srv, tenant="acme"))
    assert all(r["slo_met"] for r in met) and not any(r["slo_met"] for r in unmet)


def test_refusals_are_counted_per_tenant_class_and_reason(srv):
    with pytest.raises(openai.PermissionDeniedError):
        srv.client(ACME).completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"slo_class": "interactive"}
        )
    u = get(srv, "/v1/usage", ACME).json()
    got = [
        r
        for r in u["refusals"]
        if (r["tenant"], r["slo_class"], r["reason"], r["status"])
        == ("acme", "interactive", "slo_class_not_allowed", 403)
    ]
    assert got and got[0]["count"] >= 1


def test_past_window_report_from_the_ledger(srv):
    srv.client(ACME).completions.create(model="tiny", prompt="report", max_tokens=3)
    rep = get(srv, "/v1/slo/report", OPS, since="-1h").json()
    assert rep["source"] == "ledger"
    rows = rows_of(srv, since=str(time.time() - 3600))
    chat = [r for r in rows if r["slo_class"] == "chat"]
    c = rep["classes"]["chat"]
    assert c["requests"] == len(chat)
    assert c["violations"] == sum(not r["slo_met"] for r in chat)
    assert c["attainment"] == pytest.approx(sum(r["slo_met"] for r in chat) / len(chat))
    assert c["charge"] == pytest.approx(sum(r["charge"] for r in chat))
    ttfts = sorted(r["ttft_ms"] for r in chat)
    assert c["ttft_ms"]["p50"] in ttfts and c["ttft_ms"]["p99"] <= ttfts[-1]
    assert rep["classes"]["interactive"]["refusals"]["slo_class_not_allowed"] >= 1
    # a tenant's key: its own rows only
    own = get(srv, "/v1/slo/report", ACME, since="-1h").json()
    assert own["tenant"] == "acme"
    assert own["classes"]["chat"]["requests"] == sum(r["tenant"] == "acme" for r in chat)
    # without a window: the live report, as before
    assert get(srv, "/v1/slo/report", OPS).json().get("source") != "ledger"


# ---------------------------------------------------------------------- budgets


def _seconds_to_midnight(t: float) -> float:
    return (int(t // 86400) + 1) * 86400 - t


def test_daily_budgets_are_429_and_survive_a_restart(srv, db, tmp_path_factory):
    cap = srv.client(CAPPED)
    for _ in range(3):
        cap.completions.create(model="tiny", prompt="one", max_tokens=1)
    t0 = time.time()
    with pytest.raises(openai.RateLimitError) as ei:
        cap.completions.create(model="tiny", prompt="one", max_tokens=1)
    t1 = time.time()
    e = ei.value
    assert e.body["reason"] == "requests_per_day" and e.body["code"] == "budget_exceeded"
    ra = int(e.response.headers["retry-after"])
    assert int(_seconds_to_midnight(t1)) <= ra <= _seconds_to_midnight(t0) + 1
    # tokens per day: the request that crosses it is served, the next one refused
    tok = srv.client(TOKCAP)
    spent = 0
    while spent < 30:
        r = tok.completions.create(model="tiny", prompt="some tokens here", max_tokens=4)
        spent += r.usage.total_tokens
    with pytest.raises(openai.RateLimitError) as ei:
        tok.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert ei.value.body["reason"] == "tokens_per_day"
    # another server on the same database (a restart): still spent
    target = templated_target(tmp_path_factory)
    spool = str(tmp_path_factory.mktemp("spool2") / "spool.jsonl")
    again = LiveServer(engine_config(target), server_config(db, spool))
    try:
        for key, reason in ((CAPPED, "requests_per_day"), (TOKCAP, "tokens_per_day")):
            with pytest.raises(openai.RateLimitError) as ei:
                again.client(key).completions.create(model="tiny", prompt="x", max_tokens=1)
            assert ei.value.body["reason"] == reason
        again.client(OTHER).completions.create(model="tiny", prompt="x", max_tokens=1)
    finally:
        again.stop()
    u = get(srv, "/v1/usage", OPS, tenant="capped").json()
    assert sum(b["requests"] for b in u["data"]) == 3
    assert any(r["reason"] == "requests_per_day" for r in u["refusals"])


def test_servers_on_one_database_share_the_budgets(db, tmp_path_factory):
    """Replicas: two servers on the one database. Each reads the others' rows back
    (``budget_refresh_s``), so a tenant does not get its daily budget once per server."""
    target = templated_target(tmp_path_factory)
    servers = [
        LiveServer(
            engine_config(target),
            server_config(
                db,
                str(tmp_path_factory.mktemp(f"spool_r{i}") / "spool.jsonl"),
                extra=f'budget_refresh_s = 0.1\nreplica = "r{i}"\n',
            ),
        )
        for i in range(2)
    ]
    key = "sk-shared-ledger"
    try:
        for s in servers:
            for _ in range(2):
                s.client(key).completions.create(model="tiny", prompt="x", max_tokens=1)
        from server_fixtures import wait_for

        for s in servers:  # each has read the other's two rows back
            assert wait_for(lambda s=s: s.state.budgets.spent("shared")["requests_today"] >= 4, 30)
        for s in servers:
            with pytest.raises(openai.RateLimitError) as ei:
                s.client(key).completions.create(model="tiny", prompt="x", max_tokens=1)
            assert ei.value.body["reason"] == "requests_per_day"
        rows = rows_of(servers[0], tenant="shared")
        assert len(rows) == 4 and {r["replica"] for r in rows} == {"r0", "r1"}
    finally:
        for s in servers:
            s.stop()


def test_refused_bad_requests_do_not_spend_a_daily_budget(srv):
    """A 400 after admission (min_tokens above max_tokens) gives its in-flight place
    back and is not counted: the tenant's two requests a day are still there."""
    c = srv.client("sk-leak-ledger")
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            c.completions.create(
                model="tiny", prompt="x", max_tokens=1, extra_body={"min_tokens": 5}
            )
    for _ in range(2):
        c.completions.create(model="tiny", prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as ei:
        c.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert ei.value.body["reason"] == "requests_per_day"


def test_monthly_charge_budget_window():
    from adaserve.ledger import Budget, BudgetBook, OverBudget

    now = [calendar.timegm((2026, 12, 31, 23, 0, 0))]
    b = BudgetBook({"t": Budget(charge_per_month=1.0)}, clock=lambda: now[0])
    assert b.admit("t")
    b.settle("t", True, 10, 1.5, True)
    with pytest.raises(OverBudget) as ei:
        b.admit("t")
    assert ei.value.reason == "charge_per_month" and ei.value.retry_after_s == 3600
    now[0] += 3600  # January: a new month
    assert b.admit("t")


# ---------------------------------------------------------------------- database down


def test_database_down_then_back_spools_and_replays_once(tmp_path_factory):
    why = why_no_postgres()
    if why is not None:
        pytest.skip(why)
    pgs = PgServer()  # its own server: the test stops it
    try:
        url = pgs.new_database()
        target = templated_target(tmp_path_factory)
        spool = tmp_path_factory.mktemp("spool_down") / "spool.jsonl"
        s = LiveServer(engine_config(target), server_config(url, str(spool)))
        try:
            c = s.client(ACME)
            ids = [c.completions.create(model="tiny", prompt="a", max_tokens=2).id]
            pgs.stop()
            for _ in range(6):  # the server keeps serving
                ids.append(c.completions.create(model="tiny", prompt="b", max_tokens=2).id)
            assert spool.exists() and len(spool.read_text().splitlines()) >= 6
            m = scrape(s.url)
            assert m["adaserve:usage_ledger_up"][0][1] == 0
            assert m["adaserve:usage_ledger_spool_pending"][0][1] >= 6
            down = get(s, "/v1/usage/requests", OPS)
            assert down.status_code == 503
            assert down.json()["error"]["code"] == "usage_db_unavailable"
            pgs.start()
            ids.append(c.completions.create(model="tiny", prompt="c", max_tokens=2).id)
            from server_fixtures import wait_for

            assert wait_for(lambda: not s.state.ledger.writer.stats.spooling, 60)
            m = scrape(s.url)
            assert m["adaserve:usage_ledger_up"][0][1] == 1
            assert m["adaserve:usage_ledger_replayed_records_total"][0][1] >= 6
            rows = rows_of(s, tenant="acme")
            assert sorted(r["id"] for r in rows) == sorted(ids)
            u = get(s, "/v1/usage", OPS, tenant="acme").json()
            assert sum(b["requests"] for b in u["data"]) == len(ids)
            assert not spool.exists()
        finally:
            s.stop()
    finally:
        pgs.close()


def test_an_unreachable_database_fails_the_start_in_one_line(tmp_path_factory):
    from adaserve.bench.demo import free_port

    target = templated_target(tmp_path_factory)
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/nothing"
    p = subprocess.run(
        [sys.executable, "-m", "adaserve", "serve", "--model", str(target), "--no-draft"]
        + ["--policy", "ar", "--kv-cache-bytes", str(8 << 20), "--port", str(free_port())]
        + ["--usage-db", dead, "--log-level", "warning"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 1, p.stderr
    assert "adaserve serve: cannot open the usage ledger" in p.stderr
    assert "Traceback" not in p.stderr and "nothing" not in p.stderr.split("ledger:")[0]


# ---------------------------------------------------------------------- kill -9


def _spawn_server(target, db: str, port: int, tmp, log) -> subprocess.Popen:
    conf = tmp / "kill9.toml"
    conf.write_text(
        CONFIG.replace("step_delay_s = 0.005", "step_delay_s = 0.01")
        + f"db = {json.dumps(db)}\nspool = {json.dumps(str(tmp / 'spool.jsonl'))}\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "adaserve", "serve", "--model", str(target), "--no-draft"]
        + ["--policy", "ar", "--kv-cache-bytes", str(8 << 20), "--threads", "1"]
        + ["--host", "127.0.0.1", "--port", str(port), "--config", str(conf)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )


def _traffic(url: str, stop: threading.Event, done: list, lock: threading.Lock, i: int):
    """Streamed requests until stopped; a response counts once its [DONE] arrived."""
    with httpx.Client(base_url=url, timeout=30) as h:
        n = 0
        while not stop.is_set():
            n += 1
            body = {
                "model": "tiny",
                "prompt": f"client {i} request {n}",
                "max_tokens": 6 + (n % 5),
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            rid, usage, finished = None, None, False
            try:
                with h.stream(
                    "POST", "/v1/completions", json=body,
                    headers={"Authorization": f"Bearer {ACME}"},
                ) as r:  # fmt: skip
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            finished = True
                        elif line.startswith("data: {"):
                            d = json.loads(line[6:])
                            rid = d.get("id", rid)
                            usage = d.get("usage") or usage
            except (httpx.HTTPError, OSError):
                return  # the server is gone
            if finished:
                with lock:
                    done.append((rid, usage["prompt_tokens"], usage["completion_tokens"]))


@pytest.mark.slow
def test_kill_9_mid_traffic_loses_and_doubles_nothing(db, tmp_path_factory):
    from adaserve.bench.demo import free_port, wait_healthy

    target = templated_target(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("kill9")
    received: list = []
    lock = threading.Lock()
    for rnd in range(3):
        port = free_port()
        log = (tmp / f"server{rnd}.log").open("w")
        proc = _spawn_server(target, db, port, tmp, log)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, 180)
            stop = threading.Event()
            before = len(received)
            threads = [
                threading.Thread(
                    target=_traffic,
                    args=(f"http://127.0.0.1:{port}", stop, received, lock, i),
                    daemon=True,
                )
                for i in range(4)
            ]
            for t in threads:
                t.start()
            # kill once responses are completing and others are in flight
            t0 = time.monotonic()
            while len(received) < before + 8 and time.monotonic() - t0 < 120:
                time.sleep(0.01)
            time.sleep(random.uniform(0, 0.2))  # a random moment: mid-step, mid-commit
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            stop.set()
            for t in threads:
                t.join(60)
            assert len(received) >= before + 8, (tmp / f"server{rnd}.log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    store = open_store(UsageConfig(db=db))
    try:
        ids = [r[0] for r in received]
        assert len(set(ids)) == len(ids)
        rows = {}
        after = None
        while True:
            page, more = list_requests(store, tenant="acme", after=after, limit=1000)
            for r in page:
                assert r["id"] not in rows
                rows[r["id"]] = r
            if not more:
                break
            after = page[-1]["id"]
        for rid, pt, ct in received:
            assert rid in rows, f"{rid}: received in full, no row"
            assert (rows[rid]["prompt_tokens"], rows[rid]["completion_tokens"]) == (pt, ct)
        # the hourly totals count each stored row once
        tot = usage_totals(store, tenant="acme")
        assert sum(b["requests"] for b in tot) == len(rows)
        assert sum(b["completion_tokens"] for b in tot) == sum(
            r["completion_tokens"] for r in rows.values()
        )
    finally:
        store.close()
