"""A server that owns its process keeps the rest of it off the engine's cores, and a
bench client on the same machine keeps off them too (``util.threads.confine_rest``,
``kept_off``; ``bench.http_runner.off_server_cores``). Each check that changes a
process's affinity runs in a subprocess, so this one keeps its cores. Nothing here
times anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from server_fixtures import KV_BYTES, LiveServer, engine_config, model_pair

from adaserve.bench.http_runner import off_server_cores
from adaserve.util import threads

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs per-thread CPU affinity and two usable cores",
)

LOOP = r"""
import json, os, sys, threading
from adaserve.config import EngineConfig
from adaserve.server.engine_loop import EngineLoop
from adaserve.util import threads

start = sorted(os.sched_getaffinity(0))
cfg = EngineConfig(model=sys.argv[1], no_draft=True, policy="ar", kv_cache_bytes=int(sys.argv[2]))
loop = EngineLoop(cfg, confine=sys.argv[3] == "1")
loop.start(timeout=300)
seen = {}
t = threading.Thread(target=lambda: seen.update(m=sorted(os.sched_getaffinity(0))))
t.start()
t.join()
out = {
    "start": start,
    "main": sorted(os.sched_getaffinity(0)),
    "later": seen["m"],
    "engine": loop.call(lambda e: sorted(os.sched_getaffinity(0))).result(120),
    "plan": list(loop.engine.thread_plan.cores),
    "reserve": list(loop.reserve_cores),
    "usable": list(threads.usable_cores()),
    "again": list(threads.choose(env={}).cores),
    "reported": loop.provenance["threads"]["reserve_cores"],
}
loop.stop()
print(json.dumps(out))
"""


def _run(code: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", threads.ENV)}
    p = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600, env=env
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_server_confines_the_rest_of_its_process_to_the_reserve(tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    got = _run(LOOP, str(target), str(KV_BYTES), "1")
    cores, plan = got["start"], got["plan"]
    if len(cores) < 2:
        pytest.skip("this process runs on one core: nothing to pin")
    assert plan and got["engine"] == plan  # the serving loop's thread on the engine's cores
    rest = [c for c in cores if c not in plan]
    # the main thread (the HTTP loop's) and a thread it starts later: the reserve
    assert got["reserve"] == rest and got["main"] == rest and got["later"] == rest
    assert got["reported"] == rest  # the thread plan reports the reserve
    # choosing again sees the process's cores from before, not the narrowed main thread's
    assert got["usable"] == cores and got["again"] == plan


def test_an_embedded_loop_leaves_the_process_alone(tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    got = _run(LOOP, str(target), str(KV_BYTES), "0")
    cores = got["start"]
    assert got["engine"] == got["plan"]  # the engine's thread is pinned as before
    assert got["reserve"] == [] and got["main"] == cores and got["later"] == cores
    assert got["reported"] == []


KEEP_OFF = r"""
import json, os, sys, threading
from adaserve.bench.http_runner import off_server_cores
from adaserve.util import threads

if sys.argv[2] == "elsewhere":  # the server's report names another machine
    threads.machine_id = lambda: "another machine"

def masks():
    return {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}

start = sorted(os.sched_getaffinity(0))
# a helper thread on one core of its own, which must get it back after the block
ready, done = threading.Event(), threading.Event()
def helper():
    os.sched_setaffinity(0, {start[0]})
    out["helper_tid"] = str(threading.get_native_id())
    ready.set()
    done.wait()
out = {"start": start}
h = threading.Thread(target=helper)
h.start()
ready.wait()
with off_server_cores(sys.argv[1]) as note:
    out["note"], out["within"] = note, masks()
    seen = {}
    t = threading.Thread(target=lambda: (seen.update(tid=str(threading.get_native_id())), done.wait()))
    t.start()
    while "tid" not in seen:
        pass
out["after"] = masks()
out["new_tid"] = seen["tid"]
done.set()
print(json.dumps(out))
"""


def test_a_bench_client_on_the_server_machine_keeps_off_its_engine_cores(tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    srv = LiveServer(engine_config(target))
    try:
        plan = srv.http().get("/v1/slo/report").json()["engine"]["threads"]
        assert plan["pinned"] and plan["cores"] and plan["machine"] == threads.machine_id()
        got = _run(KEEP_OFF, srv.url, "here")
        other = _run(KEEP_OFF, srv.url, "elsewhere")
        # a client in the server's own process leaves its engine's thread alone
        before = os.sched_getaffinity(0)
        with off_server_cores(srv.url) as note:
            assert note is None and os.sched_getaffinity(0) == before
    finally:
        srv.stop()
    start = got["start"]
    rest = [c for c in start if c not in plan["cores"]]
    # during the run every thread of the client is off the engine's cores
    assert all(m == rest for m in got["within"].values())
    assert got["note"] and threads.describe_cores(tuple(plan["cores"])) in got["note"]
    # after it each thread has its own cores back: the helper its one core, a thread
    # started within the block the main thread's former cores
    after = got["after"]
    assert after[got["helper_tid"]] == [start[0]]
    assert after[got["new_tid"]] == start
    assert all(m == start for t, m in after.items() if t != got["helper_tid"])
    # a server on another machine (a tunnel to it, say): nothing changes
    assert other["note"] is None
    assert other["within"][other["helper_tid"]] == [other["start"][0]]
    assert all(m == other["start"] for t, m in other["within"].items() if t != other["helper_tid"])
