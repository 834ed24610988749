"""The live dashboard: a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by selenium) opens ``/dashboard`` on a server running the
shipped pair during a short mixed workload, signs in through the form (a session
cookie) and out; the page's, the data endpoint's and the session cookie's auth over
real HTTP; the pieces the page is built from; and the benchmark's offline
``report.html``."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading

import openai
import pytest
from server_fixtures import (
    LiveServer,
    boot_of,
    check_dashboard_auth,
    class_rows,
    server_test_env,
    shown,
    sign_in,
    wait_for,
)

from adaserve.config import EngineConfig
from adaserve.core.policy import Plan
from adaserve.core.trace import StepTrace, sample
from adaserve.server import parse_config
from adaserve.server.auth import TenantRegistry
from adaserve.server.config import tomllib
from adaserve.server.dashboard import COOKIE, Dashboard, Sessions
from adaserve.server.iterations import IterationLog
from adaserve.server.report import Record, ReportStore
from adaserve.util import dashboard_page

ADMIN, USER = "sk-dash-admin", "sk-dash-user"
CONFIG = f"""
[server]
model_name = "shipped"

[tenants.ops]
keys = ["{ADMIN}"]
admin = true

[tenants.acme]
keys = ["{USER}"]
"""
CLASSES = ("interactive", "chat", "batch")

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """The shipped pair (a reduced hardware profile, so that nothing is measured)."""
    prof = tmp_path_factory.mktemp("dash_prof") / "profile.json"
    prof.write_text(
        json.dumps({"verify": {"tokens": [1, 64], "latency_ms": [20.0, 40.0]}, "draft_step_ms": 5})
    )
    ecfg = EngineConfig(profile=str(prof), kv_cache_bytes=16 << 20, drift_detect=False)
    s = LiveServer(ecfg, parse_config(tomllib.loads(CONFIG)))
    yield s
    s.stop()


def _get(srv, path, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with srv.http() as h:
        return h.get(path, headers=headers)


def _workload(srv, n_per_class: int = 4) -> tuple[list, dict[str, int]]:
    """Mixed classes from two tenants: one request per class alone (admitted: nothing
    else runs), then the rest four at a time, where admission control may shed some
    (429). Returns the responses and the 429s per class."""
    jobs = [(c, i) for i in range(n_per_class) for c in CLASSES]
    shed = dict.fromkeys(CLASSES, 0)

    def one(job):
        cls, i = job
        key = ADMIN if i % 2 else USER
        try:
            return srv.client(key).completions.create(
                model="shipped",
                prompt=f"def {cls}_{i}(x):\n    return",
                max_tokens=10 + 4 * i,
                temperature=0,
                extra_body={"slo_class": cls, "ignore_eos": True},
            )
        except openai.RateLimitError:
            shed[cls] += 1
            return None

    first = [one(j) for j in jobs[: len(CLASSES)]]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        rest = list(ex.map(one, jobs[len(CLASSES) :]))
    return [r for r in first + rest if r is not None], shed


# ---------------------------------------------------------------------- auth


def test_data_endpoint_needs_an_admin_key(srv):
    r = _get(srv, "/v1/dashboard/data")
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    r = _get(srv, "/v1/dashboard/data", key="sk-wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = _get(srv, "/v1/dashboard/data", key=USER)
    assert r.status_code == 403
    err = r.json()["error"]
    assert err["type"] == "permission_error" and err["code"] == "admin_required"
    assert set(err) == {"message", "type", "param", "code"}
    r = _get(srv, "/v1/dashboard/data", key=ADMIN)
    assert r.status_code == 200 and r.json()["object"] == "dashboard"
    assert [c["name"] for c in r.json()["classes"]] == list(CLASSES)


def test_page_and_session_cookie_rules(srv):
    """The page answers 401 / 403 without an admin credential; sign-in trades the admin
    key for an HttpOnly, SameSite=Strict session cookie; sign-out ends it."""
    before = len(srv.state.dashboard.sessions)
    keep = check_dashboard_auth(srv.url, ADMIN, USER)
    assert len(srv.state.dashboard.sessions) == before + 1  # the one signed out is gone
    with srv.http() as h:
        out = h.delete("/v1/dashboard/session", headers={"Cookie": f"{COOKIE}={keep}"})
        assert out.status_code == 204
    assert len(srv.state.dashboard.sessions) == before


def test_sessions_expire_and_are_bounded():
    now = [0.0]
    s = Sessions(ttl_s=10.0, max_sessions=3, clock=lambda: now[0])
    a = s.create("ops")
    assert s.tenant(a) == "ops" and s.tenant("nope") is None
    now[0] = 5.0
    b, c, d = s.create("ops"), s.create("ops"), s.create("ops")
    assert s.tenant(a) is None  # the oldest made room
    assert len(s) == 3 and len({b, c, d}) == 3
    now[0] = 15.0
    assert s.tenant(b) is None and len(s) == 0
    e = s.create("ops")
    s.drop(e)
    assert s.tenant(e) is None


def test_open_mode_dashboard_is_open():
    """No API keys: the page and the data are open, signing in sets no cookie (the
    plain-ASGI routes the front door serves)."""
    from starlette.testclient import TestClient

    async def data():
        return {"object": "dashboard"}

    h = TestClient(Dashboard(TenantRegistry(()), data, title="t").asgi)
    page = h.get("/dashboard")
    assert page.status_code == 200 and boot_of(page.text)["mode"] == "live"
    assert boot_of(page.text)["session"] is False
    r = h.post("/v1/dashboard/session")
    assert r.status_code == 204 and "set-cookie" not in r.headers
    assert h.get("/v1/dashboard/data").json() == {"object": "dashboard"}
    r = h.put("/v1/dashboard/session")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


# ---------------------------------------------------------------------- the browser


def _close(a, b, tol=1e-9) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


def test_browser_shows_a_row_per_class_matching_the_report(srv, browser, tmp_path):
    from selenium.webdriver.common.by import By

    d = browser
    rep0 = _get(srv, "/v1/slo/report", ADMIN).json()
    before = rep0["requests"]
    done = threading.Event()
    result: dict = {}

    def run():
        try:
            result["resps"], result["shed"] = _workload(srv)
        finally:
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    d.get(srv.url + "/dashboard")
    # no key: the sign-in form and no data
    assert wait_for(lambda: shown(d, "login"), 30)
    assert not d.find_element(By.ID, "main").is_displayed()
    # a tenant without the admin role is turned away and sees nothing
    sign_in(d, USER)
    assert wait_for(lambda: "admin" in d.find_element(By.ID, "login-msg").text, 30)
    assert not class_rows(d) and not d.find_element(By.ID, "main").is_displayed()
    # the admin key: live data while the workload runs
    sign_in(d, ADMIN)
    assert wait_for(lambda: set(class_rows(d)) == set(CLASSES), 30), d.page_source[:2000]
    first = float(d.find_element(By.TAG_NAME, "body").get_attribute("data-as-of"))
    assert wait_for(
        lambda: float(d.find_element(By.TAG_NAME, "body").get_attribute("data-as-of")) > first, 30
    ), "the page did not update"
    assert done.wait(300), "the workload did not finish"
    t.join()
    assert "resps" in result, "the workload failed"
    total = before + len(result["resps"])

    def settled():
        rows = class_rows(d)
        return rows and sum(int(r["requests"][1]) for r in rows.values()) == total and rows

    rows = wait_for(settled, 30)
    assert rows, class_rows(d)
    rep = _get(srv, "/v1/slo/report", ADMIN).json()
    assert rep["requests"] == total
    for cls in CLASSES:
        got, want = rows[cls], rep["classes"][cls]
        assert got["name"][0] == cls
        assert int(got["requests"][1]) == want["requests"] and got["requests"][0] == str(
            want["requests"]
        )
        assert want["requests"] > 0
        assert _close(float(got["attainment"][1]), want["attainment"])
        assert got["attainment"][0] == f"{100 * want['attainment']:.1f} %"
        for k in ("ttft_ms", "tpot_ms"):
            for p in ("p50", "p95", "p99"):
                v = want[k][p]
                assert _close(float(got[f"{k}.{p}"][1]), v), (cls, k, p)
                assert got[f"{k}.{p}"][0] == f"{v:.1f}"
            tgt = want["targets"][k]
            assert _close(float(got[f"targets.{k}"][1]), tgt)
        share = want["verification"]["share"]
        assert _close(float(got["verification.share"][1]), share)
        # every request finished within the last minute: rolling = since start
        assert got["rolling.attainment"][0].startswith(f"{100 * want['attainment']:.1f} %")
    # speculation happened: per-iteration tree sizes and the budget were drawn
    assert any(float(rows[c]["recent.tree_per_req"][1] or 0) > 0 for c in CLASSES)
    canvases = d.execute_script("return document.querySelectorAll('.charts canvas').length")
    assert canvases >= 6
    # the 429s the clients saw, by class in the report and by reason on the page
    shed_page = d.execute_script(
        "return [...document.querySelectorAll('#shed tr[data-reason]')]"
        ".reduce((n, tr) => n + +tr.querySelector('[data-field=count]').dataset.value, 0)"
    )
    for cls in CLASSES:
        n0 = sum(rep0["classes"][cls]["shed"].values())
        assert sum(rep["classes"][cls]["shed"].values()) - n0 == result["shed"][cls]
    assert shed_page == sum(sum(c["shed"].values()) for c in rep["classes"].values())
    # what admission did, per class, as the report's engine section says
    note = d.find_element(By.ID, "admission-note").text
    for cls, a in rep["engine"]["admission"].items():
        for reason, n in a.get("refused", {}).items():
            assert f"{reason} {n}" in note, (cls, note)
        if a.get("promised_n"):
            assert f"{cls}: {a['promised_n']} admitted under load" in note, note
            assert f"met {100 * a['realised_attainment']:.1f} %" in note, note
    assert note.startswith("Admission:")
    tenants = d.execute_script(
        "return [...document.querySelectorAll('#tenants tr[data-tenant]')]"
        ".map(tr => tr.dataset.tenant)"
    )
    # a row per configured tenant (also one whose requests were all refused), each
    # showing what the usage report counts for it
    assert set(tenants) == {"ops", "acme"}
    counts = d.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#tenants tr[data-tenant]')]"
        ".map(tr => [tr.dataset.tenant, +tr.querySelector('[data-field=requests]').dataset.value]))"
    )
    for name in ("ops", "acme"):
        assert (
            counts[name]
            == rep["tenants"].get(name, {"total": {"requests": 0}})["total"]["requests"]
        )
    assert sum(counts.values()) == len(result["resps"]) + before
    shot = tmp_path / "dashboard.png"
    assert d.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the key is kept nowhere in the browser: an HttpOnly session cookie stands for it
    assert d.execute_script("return sessionStorage.length + localStorage.length") == 0
    assert d.execute_script("return document.cookie") == ""
    (cookie,) = d.get_cookies()
    assert cookie["name"] == COOKIE and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert ADMIN not in cookie["value"]
    # signing out clears what was shown, the cookie and the session
    d.find_element(By.ID, "signout").click()
    assert wait_for(lambda: not class_rows(d), 10)
    assert wait_for(lambda: shown(d, "login"), 30)
    assert not d.find_element(By.ID, "main").is_displayed()
    assert d.get_cookies() == []
    stale = {"Cookie": f"{COOKIE}={cookie['value']}"}
    with srv.http() as h:
        assert h.get("/v1/dashboard/data", headers=stale).status_code == 401


# ---------------------------------------------------------------------- the pieces


def test_rolling_attainment_counts_the_window_only():
    st = ReportStore(["a", "b"])
    for i, (cls, ok) in enumerate([("a", True), ("a", False), ("a", True), ("b", False)]):
        st.record(
            Record(cls, "t", "length", 1.0, 1.0, 2.0, 0.0, ok, 3, 0, 0, arrival=i, finished_at=i)
        )
    r = st.rolling(now=3.0, window_s=1.5)  # finished at 2 and 3
    assert r["a"] == {"requests": 1, "attained": 1, "attainment": 1.0}
    assert r["b"] == {"requests": 1, "attained": 0, "attainment": 0.0}
    r = st.rolling(now=10.0, window_s=1.0)
    assert r["a"]["requests"] == 0 and r["a"]["attainment"] is None


def test_iteration_sample_splits_the_pass_and_budget_by_class():
    tr = StepTrace(plan=Plan(budget=20), t_start=5.0, t_end=5.5)
    tr.classes = {1: "a", 2: "a", 3: "b", 4: "b"}
    tr.prefill = {4: 6}
    tr.decode = [1, 2, 3]
    tr.spec = {1: (3, 2), 2: (5, 1)}
    tr.tree_nodes = {1: 4, 2: 2, 3: 0}
    tr.accepted = {1: 3, 2: 0, 3: 0}
    s = sample(tr, 0.5)
    assert s["depth"] == 5
    assert s["tokens_by_class"] == {"a": 1 + 4 + 1 + 2, "b": 6 + 1}
    assert s["budget_share_by_class"] == {"a": 8 / 20, "b": 7 / 20}
    assert s["accepted_by_class"] == {"a": 1.5, "b": 0.0}
    assert s["tree_by_class"] == {"a": 3.0, "b": 0.0}
    log = IterationLog(t0=5.0, max_samples=2)
    for _ in range(3):
        log.record(tr)
    cols = log.series(["a", "b", "c"])
    assert cols["t"] == [0.5, 0.5] and cols["budget"] == [20, 20]
    assert cols["budget_share"]["a"] == [0.4, 0.4] and cols["tree_per_req"]["c"] == [None, None]
    # a plan without a budget has no share of one
    assert sample(StepTrace(plan=Plan()), 0.0)["budget_share_by_class"] is None


def test_page_is_self_contained_and_escapes_its_data():
    v = dashboard_page.view(
        title="t",
        model="</script><script>alert(1)</script>",
        policy="p",
        as_of_s=1.0,
        classes={},
        engine={},
        accepted_per_pos={0: 3, 1: 1},
        spec_drafts=4,
        shed={},
        fallback_iterations={},
        tenants={},
        timeline=dashboard_page.timeline_series([], []),
    )
    assert v["acceptance_by_position"] == [
        {"position": 0, "accepted": 3, "rate": 0.75},
        {"position": 1, "accepted": 1, "rate": 0.25},
    ]
    html = dashboard_page.render({"mode": "static", "runs": [v]})
    assert "<script>alert(1)" not in html
    assert not re.search(r"<script[^>]*\bsrc=", html)
    assert not re.search(r"<link[^>]*\bhref=", html)
    assert "uPlot" in html  # the vendored library is inlined


@pytest.fixture(scope="module")
def bench_out(tiny_pair, tmp_path_factory):
    """A real in-process benchmark run of two policies on the tiny pair."""
    from adaserve.cli import main

    target, draft, _ = tiny_pair
    root = tmp_path_factory.mktemp("dash_bench")
    prof = root / "profile.json"
    prof.write_text(
        json.dumps({"verify": {"tokens": [1, 64], "latency_ms": [20.0, 40.0]}, "draft_step_ms": 5})
    )
    out = root / "bench"
    rc = main(
        [
            "bench", "serve", "--model", str(target), "--draft", str(draft),
            "--profile", str(prof), "--policies", "adaserve,ar", "--num-prompts", "6",
            "--request-rate", "30", "--seed", "1", "--input-len", "6-12",
            "--output-len", "4-8", "--kv-cache-bytes", "4M", "--no-progress",
            "--no-plots", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    return out


def test_bench_writes_an_offline_html_report(bench_out):
    """report.html beside summary.md: one file with the library and the data inlined,
    no script or style fetched from anywhere."""
    out = bench_out
    html = (out / "report.html").read_text()
    assert (out / "summary.md").is_file()
    assert not re.search(r"<script[^>]*\bsrc=", html)
    assert not re.search(r"<link[^>]*\bhref=", html)
    data = boot_of(html)
    assert data["mode"] == "static"
    res = json.loads((out / "result.json").read_text())["results"]
    assert [v["policy"] for v in data["runs"]] == list(res)
    for v in data["runs"]:
        per = res[v["policy"]]["per_class"]
        assert {c["name"] for c in v["classes"]} == set(per)
        for c in v["classes"]:
            assert c["requests"] == per[c["name"]]["requests"]
            assert c["tpot_ms"]["p99"] == pytest.approx(per[c["name"]]["tpot_ms"]["p99"])
        assert len(v["timeline"]["t"]) > 0


def test_bench_report_renders_offline_in_the_browser(bench_out, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    res = json.loads((bench_out / "result.json").read_text())["results"]
    d = browser
    # no network at all: the page must need none
    d.set_network_conditions(offline=True, latency=0, download_throughput=0, upload_throughput=0)
    d.get((bench_out / "report.html").as_uri())
    for i, pol in enumerate(res):
        if i:
            Select(d.find_element(By.ID, "run")).select_by_index(i)
        want = res[pol]["per_class"]
        rows = wait_for(lambda w=want: set(class_rows(d)) == set(w) and class_rows(d), 10)
        assert rows, d.page_source[:2000]
        assert pol in d.find_element(By.ID, "meta").text
        for cls, m in want.items():
            assert rows[cls]["requests"][0] == str(m["requests"])
            assert rows[cls]["tpot_ms.p99"][0] == f"{m['tpot_ms']['p99']:.1f}"
    assert d.execute_script("return document.querySelectorAll('.charts canvas').length") >= 6
    assert d.save_screenshot(str(tmp_path / "report.png"))
