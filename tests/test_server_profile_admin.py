"""The served engine's thread plan, profile provenance, drift and stalls over real HTTP;
the explicit admin action that adopts a fresh profile (``POST /v1/admin/profile``),
admin only, never a measurement inside the loop. Profiles are made with injected
timings; nothing depends on the machine's speed."""

from __future__ import annotations

import json

import pytest
from server_fixtures import LiveServer, engine_config, model_pair, scrape, server_test_env

from adaserve.engine import profile, profiler
from adaserve.server import parse_config
from adaserve.server.config import tomllib

CONFIG = """
[server]
model_name = "tiny"
log_stats = false

[tenants.user]
keys = ["sk-user"]

[tenants.ops]
keys = ["sk-ops"]
admin = true
"""

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


def _timer(scale):
    def factory(model, kv, n_tokens, ctx):
        return lambda: scale * (1.0 + 0.02 * n_tokens + 0.001 * ctx)

    return factory


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target, draft = model_pair(tmp_path_factory)
    mp = pytest.MonkeyPatch()
    # the start-up measurement: a fake machine at 1x (no real forward timed)
    mp.setattr(profiler, "_forward_timer", _timer(1.0))
    try:  # undone even when the server fails to start (else it leaks into later tests)
        s = LiveServer(
            engine_config(target, draft, policy="adaserve"), parse_config(tomllib.loads(CONFIG))
        )
        yield s, mp
        s.stop()
    finally:
        mp.undo()


def _report(s):
    r = s.http().get("/v1/slo/report", headers={"Authorization": "Bearer sk-ops"})
    assert r.status_code == 200
    return r.json()["engine"]


def test_report_and_metrics_show_threads_profile_and_targets(srv):
    s, _ = srv
    s.client("sk-user").completions.create(model="tiny", prompt="hello", max_tokens=4)
    eng = _report(s)
    th, prof = eng["threads"], eng["profile"]
    assert th["threads"] >= 1 and th["source"] in (
        "auto",
        "OMP_NUM_THREADS",
        "ADASERVE_NUM_THREADS",
    )
    assert prof["profile"].endswith(f"-{prof['threads']}t-f{profile.FORWARD_VERSION}.json")
    assert prof["unloaded_tpot_ms"] == pytest.approx(eng["unloaded_tpot_ms"], rel=1e-3)
    assert prof["targets_from"].startswith("the profile measured")
    assert set(eng["drift"]) >= {"median_ratio", "drifted", "events"} and "stalls" in eng
    # start-up state frozen out of the collector's reach before ready (``util.gc_heap``)
    assert eng["gc"]["frozen_objects"] > 10_000 and eng["gc"]["full_collection_ms"] >= 0
    m = scrape(s.url, "sk-ops")
    assert m["adaserve:intra_op_threads"][0][1] == th["threads"]
    info = m["adaserve:thread_config_info"][0][0]
    assert info["source"] == th["source"] and info["pinned"] in ("true", "false")
    assert "adaserve:profile_drift_events_total" in m


def test_admin_reload_adopts_the_cached_profile_and_keeps_the_targets(srv):
    s, mp = srv
    before = _report(s)
    with s.http() as h:
        assert h.post("/v1/admin/profile").status_code == 401
        r = h.post("/v1/admin/profile", headers={"Authorization": "Bearer sk-user"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    # ``adaserve profile`` measured a faster machine meanwhile, adopted into the cache
    eng = s.state.loop.engine
    path = profile.cached_profile_path(eng)
    if path.is_file():
        fast = json.loads(path.read_text())
    else:  # a start-up measurement the checks flagged is not cached (a busy machine)
        fast = profile.measure(eng.target, eng.draft, reps=2, timer=_timer(1.0))
        path.parent.mkdir(parents=True, exist_ok=True)
    fast["verify"]["latency_ms"] = [0.5 * x for x in fast["verify"]["latency_ms"]]
    fast["created"] = "later"
    path.write_text(json.dumps(fast))
    with s.http() as h:
        r = h.post("/v1/admin/profile", headers={"Authorization": "Bearer sk-ops"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "reloaded" and body["profile"]["measured"] == "later"
    after = _report(s)
    assert after["profile"]["measured"] == "later"
    assert after["unloaded_tpot_ms"] == pytest.approx(
        before["unloaded_tpot_ms"]
    )  # the targets stay put
    assert after["profile"]["profile_unloaded_tpot_ms"] < after["unloaded_tpot_ms"]
    # a profile of another thread count is refused with a 409 that says why
    fast["threads"] = fast["threads"] + 5
    path.write_text(json.dumps(fast))
    with s.http() as h:
        r = h.post("/v1/admin/profile", headers={"Authorization": "Bearer sk-ops"})
    assert r.status_code == 409 and "intra-op threads" in r.json()["error"]["message"]
    assert _report(s)["profile"]["measured"] == "later"  # the old one kept serving
