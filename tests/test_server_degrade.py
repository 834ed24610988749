"""Degrade instead of refuse over real HTTP (issue 31 item 3): a request whose class
cannot admit it now is, when it or its tenant allows it (``"slo": {"on_overload":
"degrade"}``, tenant ``on_overload = "degrade"``), served in the first class along the
``degrade_to`` chain that can keep its promise, billed there and told so in its
metrics; otherwise it gets the 429 as before.

Each engine step lasts 150 ms (``step_pace_ms``; the tiny pair's passes are a few ms),
so what admission measures and predicts does not move with the machine's load. A long
interactive prompt (30 prefill chunks, 4.5 s) is in prefill when the probes arrive: an
interactive or chat probe would wait for it past its TTFT target, a batch one would not.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from server_fixtures import LiveServer, engine_config, model_pair, server_test_env, wait_for

from adaserve.server import parse_config
from adaserve.server.config import tomllib

APP_KEY = "app-9f2c41d7e8b3a5061c4d"
IDE_KEY = "ide-7b1e93c5a2d8f4061e2b"
OPS_KEY = "ops-3c8d20f9b6e14a7d5f01"
CONFIG = f"""
[server]
model_name = "tiny"
step_pace_ms = [150, 0]

[classes.interactive]
tpot_ms = 5000
ttft_ms = 3000
rank = 0
degrade_to = "chat"
price_per_1k = 4.0

[classes.chat]
tpot_ms = 5000
ttft_ms = 3200
rank = 1
degrade_to = "batch"
price_per_1k = 1.0

[classes.batch]
tpot_ms = 20000
ttft_ms = 60000
rank = 2
price_per_1k = 0.25

[tenants.app]
keys = ["{APP_KEY}"]

[tenants.ide]
keys = ["{IDE_KEY}"]
on_overload = "degrade"

[tenants.ops]
keys = ["{OPS_KEY}"]
admin = true

[engine]
default_class = "chat"
"""
CHUNK = 16
# 30 prefill chunks each, different from the first token on (no cached prefix)
LONG = [5 + (7 * i) % 50 for i in range(30 * CHUNK)]
OTHER = [6 + (11 * i) % 50 for i in range(30 * CHUNK)]

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target, draft = model_pair(tmp_path_factory)
    cfg = engine_config(
        target,
        draft,
        policy=f"adaserve:prefill_chunk={CHUNK}",
        max_num_seqs=4,
        max_prefill_tokens=CHUNK,
        drift_detect=False,
    )
    s = LiveServer(cfg, parse_config(tomllib.loads(CONFIG)))
    yield s
    s.stop()


def _post(url, key, **body):
    body = {"model": "tiny", "prompt": "x = ", "max_tokens": 3, "ignore_eos": True, **body}
    with httpx.Client(base_url=url, timeout=120) as h:
        return h.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def test_degrade_instead_of_refuse_served_billed_and_told(srv):
    # 34 paced passes, so the measured speed is the paced one
    assert _post(srv.url, APP_KEY, prompt=LONG, max_tokens=4, slo_class="batch").status_code == 200
    sched = srv.state.loop.engine.scheduler
    with concurrent.futures.ThreadPoolExecutor(5) as ex:
        long = ex.submit(
            _post, srv.url, APP_KEY, prompt=OTHER, max_tokens=2, slo_class="interactive"
        )
        wait_for(lambda: any(r.in_prefill and r.num_cached > 0 for r in sched.running), 30)
        probes = {
            "app": ex.submit(_post, srv.url, APP_KEY, slo_class="interactive"),
            "app_degrade": ex.submit(
                _post, srv.url, APP_KEY, slo_class="interactive", slo={"on_overload": "degrade"}
            ),
            "ide": ex.submit(_post, srv.url, IDE_KEY, slo_class="interactive"),
            "ide_refuse": ex.submit(
                _post, srv.url, IDE_KEY, slo_class="interactive", slo={"on_overload": "refuse"}
            ),
        }
        rs = {k: f.result() for k, f in probes.items()}
        assert long.result().status_code == 200
    # refused where nothing allows degrading: the 429 as before, for its own class
    for k in ("app", "ide_refuse"):
        r = rs[k]
        assert r.status_code == 429, (k, r.text)
        e = r.json()["error"]
        assert e["reason"] == "ttft" and "class 'interactive'" in e["message"]
        assert int(r.headers["retry-after"]) >= 1
    # degraded: chat's 3.2 s is also too short, batch's 60 s is not
    for k in ("app_degrade", "ide"):
        r = rs[k]
        assert r.status_code == 200, (k, r.text)
        body = r.json()
        m = body["metrics"]
        assert m["slo_class"] == "batch" and m["degraded_from"] == "interactive", m
        assert m["ttft_target_ms"] == pytest.approx(60000)
        # billed at batch's price per 1k generated tokens, not interactive's 4.0
        assert m["charge"] == pytest.approx(body["usage"]["completion_tokens"] * 0.25 / 1000)
    auth = {"Authorization": f"Bearer {OPS_KEY}"}
    rep = srv.http().get("/v1/slo/report", headers=auth).json()
    assert rep["classes"]["batch"]["degraded_in"] == 2
    assert rep["classes"]["interactive"]["degraded_out"] == 2
    assert rep["classes"]["interactive"]["shed"]["ttft"] == 2
    assert sched.counters.degraded_on_admission == {"ttft": 2}
    for tenant in ("app", "ide"):
        usage = rep["tenants"][tenant]["classes"]["batch"]
        assert usage["degraded"] == 1, rep["tenants"][tenant]
