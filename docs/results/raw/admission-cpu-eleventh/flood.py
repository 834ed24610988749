"""A client flooding a live server with requests it refuses, beside requests it serves.

Victims: VICTIMS chat requests of 300 tokens, sent together on an idle server; 0.3 s
later the flood: WORKERS streams that send interactive requests back to back and ignore
Retry-After, until the victims finish. Prints the victims' TPOT, the flood's requests
per second and how long a 429 took (WORKERS 0: the victims alone).
Usage: python flood.py BASE_URL [WORKERS] [VICTIMS]"""
import asyncio
import json
import statistics
import sys
import time

import httpx

url = sys.argv[1]
WORKERS = int(sys.argv[2]) if len(sys.argv) > 2 else 16
VICTIMS = int(sys.argv[3]) if len(sys.argv) > 3 else 2


async def stream(c, cls, n, prompt):
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "slo_class": cls}
    t0 = time.perf_counter()
    times = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, time.perf_counter() - t0, None
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                ch = json.loads(line[5:])["choices"]
                if ch and ch[0].get("text"):
                    times.append(time.perf_counter())
    # a chunk carries a pass's tokens: first chunk to last over n - 1 tokens, as the
    # overload bench counts (``ignore_eos``: every stream gives its n tokens)
    tpot = (times[-1] - times[0]) * 1000 / (n - 1) if len(times) > 1 else None
    return 200, time.perf_counter() - t0, tpot


async def main():
    stop = False
    codes, lat = {}, []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:

        async def flooder(i):
            k = 0
            while not stop:
                code, dt, _ = await stream(c, "interactive", 32, f"f{i} {k} w1 w2")
                codes[code] = codes.get(code, 0) + 1
                if code == 429:
                    lat.append(dt * 1000)
                k += 1

        t0 = time.perf_counter()
        victims = [
            asyncio.create_task(stream(c, "chat", 300, f"v{j} w3 w4 w5")) for j in range(VICTIMS)
        ]
        await asyncio.sleep(0.3)
        tasks = [asyncio.create_task(flooder(i)) for i in range(WORKERS)]
        got = await asyncio.gather(*victims)
        dur = time.perf_counter() - t0
        tpots = [t for code, _, t in got if code == 200 and t is not None]
        stop = True
        await asyncio.gather(*tasks)
    print(json.dumps({
        "victim_tpot_ms": sorted(round(t, 2) for t in tpots),
        "victim_tpot_p50": round(statistics.median(tpots), 2) if tpots else None,
        "victims_served": len(tpots),
        "flood_rps": round(sum(codes.values()) / max(dur - 0.3, 0.1), 1),
        "flood_codes": codes,
        "refusal_ms_p50": round(statistics.median(lat), 1) if lat else None,
        "seconds": round(dur, 1)}))


asyncio.run(main())
