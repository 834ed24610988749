"""Two engine replicas on a local Ray cluster (``adaserve serve --replicas 2``) against
one engine (``adaserve serve``), on this machine, with the shipped pair.

Both run as deployed: ``adaserve serve`` and ``adaserve serve --replicas 2``, each its
own process (the cluster's front door with the Ray driver), stopped with SIGINT.

1. Overhead: the same one-token completion sent one at a time to the single server and
   to the cluster's front door, alternated round by round (machine-speed drift hits
   both alike). Prints, per round, the median latency of each and the difference: what
   the front door, the Ray Serve handle, the request router and the replica's relay
   add to a request.
2. A short mixed workload on the cluster: Poisson arrivals, the three classes, half
   streamed, prompts and outputs of varied length; every request must be answered
   (a result or an OpenAI-shaped error: none lost), and per-class attainment is read
   from the service's ``/v1/slo/report``.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_cluster.py [--rounds 5] [--per-round 20]
        [--requests 60] [--rate 4] [--router slo] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

ENGINE_TOML = """
[engine]
auto_profile = false
reprofile_on_drift = false
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argv: list[str], env: dict, log: Path, timeout_s: float = 600):
    """``adaserve serve ...`` as its own process (as deployed); waits for /health."""
    port = _free_port()
    cmd = [sys.executable, "-m", "adaserve", "serve", "--port", str(port), *argv]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{' '.join(cmd)} did not start in {timeout_s:.0f} s")


def _stop(proc) -> int:
    """SIGINT (a graceful drain) and the exit status."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return -9


def overhead(single_url: str, cluster_url: str, rounds: int, per_round: int) -> list[dict]:
    body = {"model": "adaserve", "prompt": "def fib(n):", "max_tokens": 1}
    out = []
    with httpx.Client(timeout=60) as c:
        for url in (single_url, cluster_url):  # warm up both
            for _ in range(3):
                c.post(url + "/v1/completions", json=body).raise_for_status()
        for r in range(rounds):
            row = {"round": r}
            order = (("single", single_url), ("cluster", cluster_url))
            for name, url in order if r % 2 == 0 else order[::-1]:
                ms = []
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    c.post(url + "/v1/completions", json=body).raise_for_status()
                    ms.append((time.perf_counter() - t0) * 1000)
                row[name + "_ms"] = statistics.median(ms)
            row["overhead_ms"] = row["cluster_ms"] - row["single_ms"]
            out.append(row)
            print(
                f"round {r}: single {row['single_ms']:.1f} ms, cluster {row['cluster_ms']:.1f} "
                f"ms, overhead {row['overhead_ms']:+.1f} ms",
                flush=True,
            )
    return out


async def mixed(url: str, n: int, rate: float, seed: int = 0) -> dict:
    rng = random.Random(seed)
    classes = ("interactive", "chat", "batch")
    outcomes: dict[str, int] = {"ok": 0, "error": 0}
    errors: list[str] = []
    replicas: dict[str, int] = {}
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0, timeout=120
    ) as c:

        async def one(i: int):
            cls = classes[i % 3]
            body = dict(
                model="adaserve",
                prompt=f"{i}: " + "lorem ipsum " * rng.randint(1, 40),
                max_tokens=rng.randint(4, 48),
                extra_body={"slo_class": cls},
            )
            try:
                if i % 2:
                    stream = await c.completions.create(stream=True, **body)
                    rid = stream.response.headers.get("x-adaserve-replica")
                    async for _ in stream:
                        pass
                else:
                    raw = await c.completions.with_raw_response.create(**body)
                    rid = raw.headers.get("x-adaserve-replica")
                    raw.parse()
                outcomes["ok"] += 1
                replicas[rid] = replicas.get(rid, 0) + 1
            except openai.APIError as e:
                outcomes["error"] += 1
                errors.append(str(e)[:200])

        tasks = []
        for i in range(n):
            tasks.append(asyncio.ensure_future(one(i)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.wait_for(asyncio.gather(*tasks), 600)
    rep = httpx.get(url + "/v1/slo/report", timeout=30).json()
    lost = n - outcomes["ok"] - outcomes["error"]
    return {
        "requests": n,
        **outcomes,
        "lost": lost,
        "errors_sample": errors[:5],
        "by_replica": replicas,
        "attainment": {k: v["attainment"] for k, v in rep["classes"].items()},
        "report_requests": rep["requests"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--per-round", type=int, default=20)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=4.0, help="mixed workload arrivals per s")
    p.add_argument("--router", default="slo", choices=["slo", "p2c", "rr"])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every engine")
    p.add_argument("--kv-cache-bytes", type=int, default=64 << 20, help="KV pool of each engine")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="adaserve-bench-cluster-"))
    # no hardware profile on either side (none measured, none read from the user's
    # cache): nothing measured under another load decides admission
    (work / "cache").mkdir()
    (work / "engine.toml").write_text(ENGINE_TOML)
    # one intra-op thread each, as Ray gives a replica with no CPU reservation (on a
    # small shared machine a thread pool per engine costs several times more than it
    # brings); --threads to change it for both
    from adaserve.util import jit

    env = {
        **os.environ,
        "ADASERVE_CACHE": str(work / "cache"),
        "OMP_NUM_THREADS": str(args.threads),
    }
    warm = jit.cache_folder()  # the numba kernels compiled before, with no profile
    if warm is not None:
        env["NUMBA_CACHE_DIR"] = str(warm)
    conf = ["--config", str(work / "engine.toml"), "--log-level", "warning"]
    conf += ["--kv-cache-bytes", str(args.kv_cache_bytes)]  # each engine (CPU default: 1/4 RAM)
    single, s_url, s_up = _start(conf, env, work / "single.log")
    cluster, c_url, c_up = _start(
        [*conf, "--replicas", "2", "--router", args.router], env, work / "cluster.log"
    )
    print(f"single up in {s_up:.0f} s, cluster up in {c_up:.0f} s (logs in {work})", flush=True)
    try:
        rows = overhead(s_url, c_url, args.rounds, args.per_round)
        ov = [r["overhead_ms"] for r in rows]
        print(f"overhead per request: median {statistics.median(ov):.1f} ms over {len(ov)} rounds")
        mix = asyncio.run(mixed(c_url, args.requests, args.rate))
        print("mixed workload on 2 replicas:", json.dumps(mix), flush=True)
    finally:
        rc_cluster = _stop(cluster)
        rc_single = _stop(single)
    print(f"exit status after SIGINT: cluster {rc_cluster}, single {rc_single}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"overhead": rows, "mixed": mix, "router": args.router, "exit": rc_cluster},
                indent=1,
            )
        )
    return 0 if mix["lost"] == 0 and rc_cluster == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
