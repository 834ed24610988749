"""Issue 32's attacks against a live ``adaserve serve`` (the shipped pair), each beside
a victim tenant's 2-token completions: is the victim within 2x of its idle latency?

    python benchmarks/attacks.py [--rounds 3] [--probes 5] [--out docs/results/raw/attacks.json]

The server runs as deployed (its own process, a TOML config with four tenants). Each
round times ``--probes`` victim requests idle, then while one attack runs (attackers
are their own processes, as remote clients would be), for every attack:

- ``endless_header``: one socket streams a header forever, reconnecting when closed;
- ``endless_url``: the same with the request line;
- ``oversized_40``: 40 concurrent 80 KB prompts longer than the context from a
  ``max_concurrent = 3`` tenant, again and again;
- ``silent_1000``: 1,000 sockets that send nothing, reopened as they are closed.

Then, once: a 10-rpm tenant sends 100 oversized prompts (how many got past its quota?),
and wrong keys are guessed for 3 s (how many answered 401 before the 429s?). Attackers
here share the server's cores, which remote ones would not: the ratios are an upper
bound. A timing measurement: run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CONFIG = """
[server]
log_stats = false

[tenants.victim]
keys = ["sk-victim-0123456789"]

[tenants.flood]
keys = ["sk-flood-0123456789"]
max_concurrent = 3

[tenants.rpm]
keys = ["sk-rpm-0123456789"]
requests_per_minute = 10
"""
VICTIM = "sk-victim-0123456789"
OVERSIZED = {"prompt": "word " * 16_000, "max_tokens": 1}  # 80 KB, past the context


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(workdir: Path) -> tuple[subprocess.Popen, int]:
    cfg = workdir / "server.toml"
    cfg.write_text(CONFIG)
    port = _free_port()
    log = (workdir / "server.log").open("w")
    cmd = [sys.executable, "-m", "adaserve", "serve", "--config", str(cfg), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited {proc.returncode}: see {workdir}/server.log")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start in 600 s")


def probe(base: str) -> float | None:
    """One victim request's latency in ms (None: it was not served)."""
    body = {"prompt": "x = ", "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    t = time.perf_counter()
    try:
        r = httpx.post(
            base + "/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {VICTIM}"},
            timeout=60,
        )
    except httpx.HTTPError:
        return None
    return (time.perf_counter() - t) * 1000 if r.status_code == 200 else None


# ---------------------------------------------------------------------- attackers


def _endless(port: int, head: bytes, piece: bytes, stop) -> None:
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(head)
                while not stop.is_set():
                    s.sendall(piece)
        except OSError:
            pass  # closed (431 / 414, or the header timeout): reconnect


def endless_header(port: int, stop) -> None:
    _endless(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: ", b"a" * 1024, stop)


def endless_url(port: int, stop) -> None:
    _endless(port, b"GET /health?q=", b"a" * 1024, stop)


def oversized_40(port: int, stop) -> None:
    import asyncio

    async def one(c):
        while not stop.is_set():
            try:
                await c.post("/v1/completions", json=OVERSIZED)
            except httpx.HTTPError:
                await asyncio.sleep(0.01)

    async def run():
        limits = httpx.Limits(max_connections=40)
        headers = {"Authorization": "Bearer sk-flood-0123456789"}
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers=headers, limits=limits, timeout=60
        ) as c:
            await asyncio.gather(*(one(c) for _ in range(40)))

    asyncio.run(run())


def silent_1000(port: int, stop) -> None:
    import selectors

    sel = selectors.DefaultSelector()

    def open_one():
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        except OSError:
            time.sleep(0.01)

    for _ in range(1000):
        open_one()
    while not stop.is_set():
        for key, _ in sel.select(timeout=0.1):  # readable: closed by the server
            sel.unregister(key.fileobj)
            key.fileobj.close()
            open_one()
    for key in list(sel.get_map().values()):
        key.fileobj.close()


def _niced(name: str, port: int, stop, nice: int) -> None:
    if nice:
        os.nice(nice)
    ATTACKS[name](port, stop)


ATTACKS = {
    "endless_header": endless_header,
    "endless_url": endless_url,
    "oversized_40": oversized_40,
    "silent_1000": silent_1000,
}


def _p50(xs: list) -> float | None:
    ok = [x for x in xs if x is not None]
    return statistics.median(ok) if ok else None


def quota_past(base: str) -> dict:
    """A 10-rpm tenant's 100 oversized prompts, sent back to back, ignoring Retry-After:
    their answers, how long they took, and how many requests the quota allowed in that
    time (10 at once, then 10 a minute as the bucket refills)."""
    codes: dict[int, int] = {}
    headers = {"Authorization": "Bearer sk-rpm-0123456789"}
    t0 = time.monotonic()
    with httpx.Client(base_url=base, headers=headers, timeout=30) as c:
        for _ in range(100):
            code = c.post("/v1/completions", json=OVERSIZED).status_code
            codes[code] = codes.get(code, 0) + 1
    took = time.monotonic() - t0
    return {"answers": codes, "seconds": took, "allowed": 10 + int(took * 10 / 60)}


def guesses(base: str, seconds: float = 3.0) -> dict:
    codes: dict[int, int] = {}
    t0 = time.monotonic()
    with httpx.Client(base_url=base, timeout=10) as c:
        i = 0
        while time.monotonic() - t0 < seconds:
            r = c.get("/v1/models", headers={"Authorization": f"Bearer sk-guess-{i}"})
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            i += 1
    return {"answers": codes, "per_s": sum(codes.values()) / seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run the attackers at this lower priority (os.nice), standing for remote "
        "clients that do not share the server's cores (0: same priority, the upper bound)",
    )
    a = p.parse_args()
    names = [n for n in a.attacks.split(",") if n]
    for n in names:
        if n not in ATTACKS:
            p.error(f"unknown attack {n!r}; known: {', '.join(ATTACKS)}")
    work = Path(tempfile.mkdtemp(prefix="adaserve-attacks-"))
    proc, port = start_server(work)
    base = f"http://127.0.0.1:{port}"
    res: dict = {"attacks": {}, "rounds": a.rounds, "probes": a.probes, "nice": a.nice}
    try:
        for _ in range(3):
            probe(base)  # warm
        idle: dict[str, list] = {n: [] for n in names}
        hit: dict[str, list] = {n: [] for n in names}
        for _ in range(a.rounds):
            for n in names:
                idle[n] += [probe(base) for _ in range(a.probes)]
                stop = mp.Event()
                atk = mp.Process(target=_niced, args=(n, port, stop, a.nice), daemon=True)
                atk.start()
                time.sleep(1.5)  # under way
                hit[n] += [probe(base) for _ in range(a.probes)]
                stop.set()
                atk.join(10)
                if atk.is_alive():
                    atk.kill()
                time.sleep(0.5)
        for n in names:
            mi, mh = _p50(idle[n]), _p50(hit[n])
            res["attacks"][n] = {
                "idle_p50_ms": mi,
                "attacked_p50_ms": mh,
                "ratio": (mh / mi) if (mi and mh) else None,
                "victim_served": sum(x is not None for x in hit[n]),
                "victim_sent": len(hit[n]),
            }
        res["quota_10rpm_100_oversized"] = quota_past(base)
        res["wrong_keys_3s"] = guesses(base)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"{'attack':<16} {'idle p50':>9} {'attacked':>9} {'ratio':>6}  victim served")
    for n, r in res["attacks"].items():
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        fmt = lambda v: f"{v:.1f}" if v else "-"  # noqa: E731
        print(
            f"{n:<16} {fmt(r['idle_p50_ms']):>9} {fmt(r['attacked_p50_ms']):>9} {ratio:>6}  "
            f"{r['victim_served']}/{r['victim_sent']}"
        )
    q = res["quota_10rpm_100_oversized"]
    served = sum(v for k, v in q["answers"].items() if k != 429)
    print(
        f"10-rpm tenant, 100 oversized prompts in {q['seconds']:.0f} s: answers "
        f"{q['answers']}; the quota allowed {q['allowed']} (past it: "
        f"{max(0, served - q['allowed'])})"
    )
    g = res["wrong_keys_3s"]
    print(f"wrong keys for 3 s: {g['per_s']:.0f} answers/s, {g['answers']}")
    res["machine"] = {"cpus": os.cpu_count()}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
