"""One tenant floods a live server with huge prompts; how much slower is another
tenant's small request? (Issue 22 finding 2: the goal is less than 2x its idle latency.)

    python benchmarks/flood.py --base-url http://127.0.0.1:8000 \
        --flood-key sk-a --victim-key sk-b [--rounds 20] [--flooders 4]

Idle and flooded rounds alternate (side by side, so the machine's drift cancels): each
round times ``--probes`` 2-token completions of the victim, alone, or while
``--flooders`` threads keep sending 7.9 MB prompts. Prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx

HUGE = "def f(x):\n    return x  # " + "x" * (7_900_000 - 28)


def probe(base: str, key: str, model: str | None) -> float:
    body = {"prompt": "x = ", "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    if model:
        body["model"] = model
    t = time.perf_counter()
    r = httpx.post(
        base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )
    if r.status_code != 200:  # the victim was refused: its latency is not a success
        raise SystemExit(f"the victim's request got {r.status_code}: {r.text[:300]}")
    return (time.perf_counter() - t) * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--flood-key", required=True)
    p.add_argument("--victim-key", required=True)
    p.add_argument("--model")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--flooders", type=int, default=4)
    a = p.parse_args()
    idle, flooded, codes = [], [], {}
    for _ in range(a.rounds):
        idle += [probe(a.base_url, a.victim_key, a.model) for _ in range(a.probes)]
        stop = threading.Event()

        def flood(stop=stop):
            with httpx.Client(base_url=a.base_url, timeout=300) as c:
                while not stop.is_set():
                    r = c.post(
                        "/v1/completions",
                        json={"prompt": HUGE, "max_tokens": 1, "model": a.model},
                        headers={"Authorization": f"Bearer {a.flood_key}"},
                    )
                    codes[r.status_code] = codes.get(r.status_code, 0) + 1

        ts = [threading.Thread(target=flood) for _ in range(a.flooders)]
        for t in ts:
            t.start()
        time.sleep(0.5)  # the flood is under way
        flooded += [probe(a.base_url, a.victim_key, a.model) for _ in range(a.probes)]
        stop.set()
        for t in ts:
            t.join()
    mi, mf = statistics.median(idle), statistics.median(flooded)
    print(f"victim 2-token request: idle median {mi:.1f} ms, flooded median {mf:.1f} ms")
    print(f"ratio {mf / mi:.2f}x over {len(idle)} + {len(flooded)} probes; flood answers {codes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
