"""What a local Ray cluster of ``adaserve serve --replicas`` exposes and leaves behind,
and what a killed replica had already streamed.

- A real local cluster started as the server starts it (``serve_app.init_local_ray``,
  then Ray Serve, an actor and a Serve replica set up as ``EngineReplica``), in a
  child process: every listening socket of every process under it is on loopback;
  ``kill -9`` of the child (the front door) leaves none of its Ray processes running.
- The reaper's mark: leftovers of a dead owner are killed at the next start, a live
  owner's are not.
- A stream its replica breaks off: the output tokens relayed to the client are counted
  in the tenant's usage and the report (the front door, the ledger and the merge, with
  a stream that fails mid-way), and a replica tags what it relays with them.

The child's cluster costs about 10-15 s; the rest is unit-level."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'adaserve[ray]')")

import ray  # noqa: E402, F401

from adaserve.cluster import reaper  # noqa: E402
from adaserve.cluster.front_door import FrontDoor  # noqa: E402
from adaserve.cluster.ledger import Ledger  # noqa: E402
from adaserve.cluster.merge import merge_report  # noqa: E402
from adaserve.cluster.serve_app import local_ray_kwargs  # noqa: E402
from adaserve.server import parse_config  # noqa: E402
from adaserve.server.config import tomllib  # noqa: E402
from adaserve.server.state import RequestCtx  # noqa: E402

psutil = pytest.importorskip("psutil")  # after ray: Ray's packaged one
linux = pytest.mark.skipif(not reaper.supported(), reason="the reaper reads /proc (Linux)")

# the front door's start-up of a local cluster, then what the replicas are to Ray
CHILD = """
import logging, os, sys, time
import ray
from ray import serve
from adaserve.cluster.serve_app import NAMESPACE, init_local_ray

os.environ.setdefault("RAY_worker_niceness", "0")
init_local_ray(num_cpus=2, namespace=NAMESPACE, include_dashboard=False,
               logging_level=logging.WARNING)
serve.start(proxy_location="Disabled")

@ray.remote(num_cpus=0)
class Replica:
    def pid(self):
        return os.getpid()

r = Replica.remote()
ray.get(r.pid.remote(), timeout=60)

@serve.deployment(ray_actor_options={"num_cpus": 0})
class Tiny:  # a Serve replica, set up as EngineReplica is
    def __init__(self):
        from adaserve.cluster.replica import bind_serve_grpc_to_loopback
        bind_serve_grpc_to_loopback()

    def __call__(self):
        return os.getpid()

serve.run(Tiny.bind(), name="tiny", route_prefix=None).remote().result(timeout_s=60)
print("READY", flush=True)
time.sleep(600)
"""


def _listening(proc: psutil.Process) -> list[tuple[str, int]]:
    try:
        conns = proc.net_connections(kind="inet")
    except psutil.Error:
        return []
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


def _loopback(ip: str) -> bool:
    a = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return a.is_loopback


def _alive(procs) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.fixture(scope="module")
def front_door(tmp_path_factory):
    """The child (a front door with its local cluster) and every process under it."""
    cache = tmp_path_factory.mktemp("adaserve_cache")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, "ADASERVE_CACHE": str(cache)},
    )
    procs: list[psutil.Process] = []
    try:
        line = child.stdout.readline()
        assert line.strip() == "READY", "the child's Ray cluster did not start"
        me = psutil.Process(child.pid)
        procs = [me, *me.children(recursive=True)]
        yield SimpleNamespace(
            child=child, procs=procs, token=reaper.owner_token(child.pid), state=cache / "ray"
        )
    finally:
        for p in _alive(procs):
            if p.pid != os.getpid():
                p.kill()
        child.kill()
        child.wait()


def test_local_cluster_listens_on_loopback_only(front_door):
    names = {p.pid: p.name() for p in _alive(front_door.procs)}
    # the GCS, the raylet and the agents at least (Ray's own processes)
    assert {"gcs_server", "raylet"} <= set(names.values()), names
    assert any(n.startswith("ray::ServeReplica") for n in names.values()), names
    sockets = {p.pid: _listening(p) for p in _alive(front_door.procs)}
    assert sum(map(len, sockets.values())) >= 8, sockets  # GCS, raylet, agents, workers
    exposed = {
        f"{names.get(pid)}[{pid}]": [a for a in addrs if not _loopback(a[0])]
        for pid, addrs in sockets.items()
    }
    assert not any(exposed.values()), exposed


@linux
def test_kill_9_of_the_front_door_leaves_no_ray_process(front_door):
    """(Last of the two: it kills the module's front door.) Ray's agents alone would
    wait 60 s on the dead GCS before they exit."""
    ray_procs = [p for p in _alive(front_door.procs) if p.pid != front_door.child.pid]
    names = {p.name() for p in ray_procs}
    assert {"raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names, names
    # (up to one watch period for the watchdog to have seen them: its state file, kept
    # for the next start too, lists them)
    state = front_door.state / (front_door.token.replace(":", "-") + ".pids")
    agents = {p.pid for p in ray_procs if p.name().startswith("ray::")}
    t0 = time.monotonic()
    while not agents <= set(reaper.read_state(str(state))) and time.monotonic() - t0 < 5:
        time.sleep(0.1)
    os.kill(front_door.child.pid, signal.SIGKILL)
    front_door.child.wait()
    t0 = time.monotonic()
    while _alive(ray_procs) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    left = [(p.pid, p.name()) for p in _alive(ray_procs)]
    assert not left, f"{len(left)} Ray process(es) outlived the front door: {left}"
    assert not state.exists()


@linux
def test_leftovers_of_a_dead_owner_are_reaped_at_the_next_start(tmp_path):
    """What a dead owner's state file lists, and what still shows its mark, is killed;
    a live owner's processes are not."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = f"{dead.pid}:1"  # that pid's process (if any now) did not start at tick 1
    live = reaper.owner_token()

    def sleeper(token=None):
        env = {**os.environ, reaper.MARKER: token} if token else None
        return subprocess.Popen(["sleep", "60"], env=env)

    listed, shown, mine, mine_shown = sleeper(), sleeper(gone), sleeper(), sleeper(live)
    procs = (listed, shown, mine, mine_shown)
    for tok, p in ((gone, listed), (live, mine)):
        state = tmp_path / (tok.replace(":", "-") + ".pids")
        state.write_text(f"{p.pid} {reaper._start_time(p.pid)}\n")
    try:
        assert not reaper.owner_alive(gone) and reaper.owner_alive(live)
        killed = reaper.reap_orphans(str(tmp_path))
        assert sorted(killed.get(gone, [])) == sorted([listed.pid, shown.pid]), killed
        assert live not in killed
        assert listed.wait(5) == shown.wait(5) == -signal.SIGKILL
        assert mine.poll() is None and mine_shown.poll() is None
        assert [f.name for f in tmp_path.iterdir()] == [live.replace(":", "-") + ".pids"]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_bind_host_choices():
    loop = {"_node_ip_address": "127.0.0.1", "dashboard_host": "127.0.0.1"}
    assert local_ray_kwargs(None) == local_ray_kwargs("localhost") == loop
    assert local_ray_kwargs("0.0.0.0") == local_ray_kwargs("::") == {}  # Ray's defaults
    assert local_ray_kwargs("10.1.2.3")["_node_ip_address"] == "10.1.2.3"


# ---------------------------------------------------------------- interrupted streams

CONFIG = """
[tenants.user]
keys = ["sk-user"]
"""


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


class AsActor:
    """A plain object with a Ray actor handle's shape (``obj.method.remote(...)``)."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        return SimpleNamespace(remote=getattr(self.obj, name))


class DyingHandle:
    """A deployment handle whose replica streams ``msgs``, then dies."""

    def __init__(self, msgs):
        self.msgs = msgs

    def options(self, **kw):
        return self

    def remote(self, route, req):
        msgs = self.msgs

        class Gen:
            def __aiter__(self):
                async def it():
                    for m in msgs:
                        yield m
                    raise RuntimeError("ActorDiedError: the replica died")

                return it()

            def cancel(self):
                pass

        return Gen()


def _sse(i: int) -> bytes:
    return f'data: {{"choices": [{{"index": 0, "text": "t{i}"}}]}}\n\n'.encode()


async def _post(app, body: bytes, headers: tuple = (), key: bytes = b"sk-user") -> list[dict]:
    sent, got = [], False

    async def receive():
        nonlocal got
        if not got:
            got = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()

    async def send(msg):
        sent.append(msg)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [
            (b"authorization", b"Bearer " + key),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
        "http_version": "1.1",
        "scheme": "http",
    }
    await app(scope, receive, send)
    return sent


def test_tokens_a_dying_replica_had_streamed_are_counted():
    cfg = parse_config(tomllib.loads(CONFIG))
    clock = Clock()
    led = Ledger(cfg.tenants, stale_s=5.0, clock=clock)
    for rid in ("r1", "r2"):
        led.push(rid, {"usage": {}}, [], [])
    acct = {"replica": "r1", "tenant": "user", "cls": "chat", "price_per_1k": 2.0,
            "prompt_tokens": 7}  # fmt: skip
    headers = [(b"content-type", b"text/event-stream"), (b"x-adaserve-replica", b"r1")]
    msgs = [
        ("accepted",),
        ("many", [("acct", acct), ("start", 200, headers), ("body", _sse(0), True, 2)]),
        ("body", _sse(1), True, 5),
    ]
    front = FrontDoor(DyingHandle(msgs), AsActor(led), cfg, "m")
    body = json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()
    sent = asyncio.run(_post(front, body))
    # the client got both chunks, then the error event and [DONE]
    text = b"".join(m.get("body", b"") for m in sent).decode()
    assert text.count('"text"') == 2 and "replica_failed" in text and "[DONE]" in text
    # r1 is not known dead yet: nothing counted until it is
    rep = merge_report(led.snapshots(), None, "m")
    assert rep["tenants"] == {} and rep["engine"]["interrupted"]["requests"] == 0
    # r2 lives on (it pushes) and a claim against it is dropped: it counts its own
    led.interrupted("r2", {**acct, "replica": "r2"}, 9)
    clock.t = 3.0
    led.push("r2", {"usage": {}}, [], [])
    clock.t = 6.0  # r1 silent for longer than stale_s: dead
    led.push("r2", {"usage": {}}, [], [])
    rep = merge_report(led.snapshots(), None, "m")
    u = rep["tenants"]["user"]["total"]
    assert (u["requests"], u["prompt_tokens"], u["completion_tokens"]) == (1, 7, 5)
    assert u["charge"] == pytest.approx(5 * 2.0 / 1000)
    assert rep["tenants"]["user"]["classes"]["chat"]["completion_tokens"] == 5
    assert rep["engine"]["interrupted"] == {"requests": 1, "completion_tokens": 5}
    assert merge_report(led.snapshots(), "other", "m")["engine"]["interrupted"]["requests"] == 0


class SeatHandle:
    """A deployment handle over two replicas that records each request's route; r2
    answers the first request 429 with a seat (``Retry-Token``), the rest 200."""

    def __init__(self):
        self.routes: list[dict] = []

    def options(self, **kw):
        return self

    def remote(self, route, req):
        self.routes.append(dict(route))
        first = len(self.routes) == 1
        status, rid = (429, b"r2") if first else (200, route.get("replica", "r1").encode())
        headers = [(b"content-type", b"application/json"), (b"x-adaserve-replica", rid)]
        if first:
            headers += [(b"retry-after", b"3"), (b"retry-after-ms", b"2500"),
                        (b"retry-token", b"seat-7")]  # fmt: skip

        class Gen:
            def __aiter__(self):
                async def it():
                    yield ("accepted",)
                    yield ("many", [("start", status, headers), ("body", b"{}", False)])

                return it()

            def cancel(self):
                pass

        return Gen()


def test_a_retry_goes_back_to_the_replica_holding_its_seat():
    """Behind replicas the seat of a refused client is held by the replica that refused
    it: the front door remembers that replica from the 429 (its ``Retry-Token`` and
    ``x-adaserve-replica``) and routes the retry there, whether it brings the token or
    is the official OpenAI client's own marked retry of the same body from the same
    caller; a fresh request with that body, or another caller's, is routed as any."""
    cfg = parse_config(tomllib.loads(CONFIG + '[tenants.other]\nkeys = ["sk-other"]\n'))
    led = Ledger(cfg.tenants, stale_s=5.0, clock=Clock())
    handle = SeatHandle()
    front = FrontDoor(handle, AsActor(led), cfg, "m")
    body = json.dumps({"model": "m", "prompt": "x"}).encode()
    sent = asyncio.run(_post(front, body))
    assert sent[0]["status"] == 429 and "replica" not in handle.routes[0]
    asyncio.run(_post(front, b'{"model": "m", "prompt": "y"}', ((b"retry-token", b"seat-7"),)))
    asyncio.run(_post(front, body, ((b"x-stainless-retry-count", b"1"),)))
    asyncio.run(_post(front, body))  # unmarked: a new request
    asyncio.run(_post(front, body, ((b"x-stainless-retry-count", b"1"),), key=b"sk-other"))
    asyncio.run(_post(front, body, ((b"retry-token", b"seat-8"),)))  # a seat it never saw
    assert [r.get("replica") for r in handle.routes[1:]] == ["r2", "r2", None, None, None]
    assert front.seats.routed == 2


def test_the_seat_routes_lapse_with_the_seats():
    """A seat's route is kept as long as admission keeps the seat (its wait, then its
    grace: ``core.retry_seats``), and a 429 without a seat (a quota's) leaves none."""
    from adaserve.cluster.seat_routes import SeatRoutes, caller_key
    from adaserve.core.retry_seats import SEAT_GRACE_S

    clock = Clock()
    routes = SeatRoutes(clock=clock)
    me = caller_key("Bearer sk-user")
    told = {"x-adaserve-replica": "r3", "Retry-Token": "t1", "retry-after-ms": "4000"}
    routes.remember(told, me, b"body")
    routes.remember({"x-adaserve-replica": "r1", "Retry-After": "1"}, me, b"quota")
    assert routes.replica_for({"Retry-Token": "t1"}, me, b"") == "r3"
    marked = {"x-stainless-retry-count": "2"}
    assert routes.replica_for(marked, me, b"body") == "r3"
    assert routes.replica_for(marked, me, b"quota") is None
    assert routes.replica_for(marked, caller_key(None), b"body") is None
    clock.t = 4.0 + SEAT_GRACE_S + 0.01  # past the seat's wait and grace
    assert routes.replica_for({"Retry-Token": "t1"}, me, b"") is None


def test_the_ray_router_puts_the_seat_s_replica_first():
    """Unless another replica can serve the retry within its targets now and the seat's
    replica cannot."""
    from adaserve.cluster.ray_router import home_first

    assert home_first(["r1", "r2", "r3"], "r3") == ["r3", "r1", "r2"]
    assert home_first(["r1", "r2"], "gone") == ["r1", "r2"]  # not a candidate any more
    assert home_first(["r1", "r2"], None) == ["r1", "r2"]
    # overloaded everywhere: its turn is kept at home
    assert home_first(["r1", "r2", "r3"], "r3", set()) == ["r3", "r1", "r2"]
    assert home_first(["r1", "r2", "r3"], "r3", {"r3"}) == ["r3", "r1", "r2"]
    # another replica can serve it now and home cannot: served now, not kept waiting
    assert home_first(["r1", "r2", "r3"], "r3", {"r1"}) == ["r1", "r2", "r3"]


def test_replica_relay_tags_what_it_sends_with_its_tokens():
    """``replica.relay`` over an app that submits to the engine loop as the server's
    does: the request's handles are found (two requests at once, apart), ``acct``
    comes first, and each body item carries the output tokens handed over by then."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from adaserve.cluster.asgi import request_data
    from adaserve.cluster.replica import count_handles, relay

    class Loop:
        async def submit(self, h):
            return None

    loop = Loop()
    count_handles(loop)

    async def gen(request):
        tenant = request.headers["x-tenant"]
        ctx = RequestCtx(tenant, "chat", 1.5, None, "default", True)
        h = SimpleNamespace(sent=0, drop_output=False, prompt_ids=[1, 2, 3], ctx=ctx)
        await asyncio.gather(loop.submit(h))  # as generation.generate submits

        async def chunks():
            for i in range(3):
                h.sent += 2
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.01)

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/gen", gen, methods=["POST"])])

    async def one(tenant):
        scope = {"method": "POST", "path": "/gen", "headers": [(b"x-tenant", tenant.encode())]}
        items = []
        async for msg in relay(app, request_data(scope, b""), "r9"):
            items.extend(msg[1] if msg[0] == "many" else [msg])
        return items

    async def both():
        return await asyncio.gather(one("a"), one("b"))

    for tenant, items in zip("ab", asyncio.run(both()), strict=True):
        kinds = [m[0] for m in items]
        assert kinds[0] == "acct" and kinds.count("acct") == 1, kinds
        acct = dict(items[0][1])
        assert acct.pop("arrival") > 0  # the usage ledger's row of a broken stream needs
        assert acct == {"replica": "r9", "tenant": tenant, "cls": "chat",  # these too
                        "price_per_1k": 1.5, "prompt_tokens": 3,
                        "id": None, "key_id": None, "class_asked": None}  # fmt: skip
        counts = [m[3] for m in items if m[0] == "body" and m[1]]
        assert counts == [2, 4, 6], items
