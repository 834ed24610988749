"""One tenant floods a live server with huge prompts; how much slower is another
tenant's small request? (Issue 22 finding 2: the goal is less than 2x its idle latency.)

    python benchmarks/flood.py --base-url http://127.0.0.1:8000 \
        --flood-key sk-a --victim-key sk-b [--rounds 20] [--flooders 4]

Idle and flooded rounds alternate (side by side, so the machine's drift cancels): each
round times ``--probes`` 2-token completions of the victim, alone, or while
``--flooders`` client processes keep sending 7.9 MB prompts. Prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
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


def _flood(
    base: str, key: str, model: str | None, stop, counts, once: bool = False, nice: int = 0
) -> None:
    """One flooding client (its own process, as separate clients would be): the huge
    prompt again and again until ``stop`` (``once``: one request); puts its status
    counts on ``counts``. ``nice``: its CPU priority lowered by that much, to stand for
    attackers on other machines when they share the server's cores here."""
    if nice:
        os.nice(nice)
    body = json.dumps({"prompt": HUGE, "max_tokens": 1, "model": model}).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    seen: dict[int, int] = {}
    with httpx.Client(base_url=base, timeout=300) as c:
        while not stop.is_set():
            try:
                code = c.post("/v1/completions", content=body, headers=headers).status_code
            except httpx.HTTPError:
                code = 0  # the server closed the connection before the body was sent
            seen[code] = seen.get(code, 0) + 1
            if once:
                break
    counts.put(seen)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--flood-key", required=True)
    p.add_argument("--victim-key", required=True)
    p.add_argument("--model")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--flooders", type=int, default=4)
    p.add_argument(
        "--once",
        action="store_true",
        help="each flooder sends one prompt per round (the attack: four 7.9 MB prompts), "
        "not a stream of them",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="lower the flooding processes' CPU priority by this much (0-19): on one "
        "machine the attackers otherwise compete for the server's cores, which remote "
        "attackers would not",
    )
    a = p.parse_args()
    if not 0 <= a.nice <= 19:
        p.error("--nice must be between 0 and 19")
    idle, flooded, codes = [], [], {}
    for _ in range(a.rounds):
        idle += [probe(a.base_url, a.victim_key, a.model) for _ in range(a.probes)]
        stop = mp.Event()
        counts = mp.Queue()
        ps = [
            mp.Process(
                target=_flood, args=(a.base_url, a.flood_key, a.model, stop, counts, a.once, a.nice)
            )
            for _ in range(a.flooders)
        ]
        for p in ps:
            p.start()
        time.sleep(0.05 if a.once else 1.0)  # the flood is under way
        flooded += [probe(a.base_url, a.victim_key, a.model) for _ in range(a.probes)]
        stop.set()
        for p in ps:
            for code, n in counts.get().items():
                codes[code] = codes.get(code, 0) + n
            p.join()
    mi, mf = statistics.median(idle), statistics.median(flooded)
    print(f"victim 2-token request: idle median {mi:.1f} ms, flooded median {mf:.1f} ms")
    print(f"ratio {mf / mi:.2f}x over {len(idle)} + {len(flooded)} probes; flood answers {codes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
