"""Pass times of the engine by thread count, alone and beside busy neighbour processes.

Each measurement is a child process that builds the engine on the shipped pair with
``--threads T`` (pinned as the server pins its engine thread, unless ``--no-pin``),
decodes ``--requests`` greedy requests of ``--tokens`` tokens together, and reports
every step's wall time. Configurations are interleaved round by round, so a drift of
the machine's speed hits them alike. ``--neighbours N`` starts N busy Python
processes (``while True: pass``) beside the child, at normal priority.

    python benchmarks/threads.py --threads 1,2 --neighbours 0,1 --rounds 3

Prints, per (threads, neighbours), the step time p50 / p99 pooled over the rounds and
their ratios to the same thread count alone; ``--json FILE`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BUSY = "while True: pass"


def _child(args) -> None:
    from adaserve.config import EngineConfig
    from adaserve.engine.engine import Engine
    from adaserve.sampling import SamplingParams
    from adaserve.util import threads

    eng = Engine(EngineConfig(policy=args.policy, threads=args.threads[0]))
    if not args.no_pin:
        threads.pin_current_thread(eng.thread_plan)
    prompts = [
        "def fibonacci(n):",
        "class Stack:\n    def __init__(self):",
        "import os\n\ndef walk(path):",
        "def parse_args(argv):",
    ]
    times = []
    for rep in range(2):  # the first repeat warms the shapes up; only the second counts
        for i in range(args.requests):
            eng.add_request(
                prompts[i % len(prompts)],
                SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True),
            )
        while eng.has_work():
            t0 = time.perf_counter()
            eng.step()
            if rep:
                times.append((time.perf_counter() - t0) * 1000)
    print(json.dumps({"step_ms": times, "threads": eng.thread_plan.as_dict()}))


def _q(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", default="1,2", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--neighbours", default="0,1", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--policy", default="ar")
    p.add_argument("--no-pin", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return 0
    configs = [(t, n) for t in args.threads for n in args.neighbours]
    runs: dict = {c: [] for c in configs}
    walls: dict = {c: [] for c in configs}
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    env.pop("ADASERVE_NUM_THREADS", None)
    for rnd in range(args.rounds):
        order = configs[rnd % len(configs) :] + configs[: rnd % len(configs)]
        for t, n in order:
            busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
            try:
                time.sleep(0.5 if n else 0.0)
                cmd = [sys.executable, __file__, "--child", "--threads", str(t)]
                cmd += ["--requests", str(args.requests), "--tokens", str(args.tokens)]
                cmd += ["--policy", args.policy] + (["--no-pin"] if args.no_pin else [])
                t0 = time.perf_counter()
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                walls[(t, n)].append(time.perf_counter() - t0)
            finally:
                for b in busy:
                    b.kill()
                    b.wait()
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs[(t, n)].append(res["step_ms"])
            print(
                f"round {rnd + 1}: threads={t} neighbours={n}: step p50 "
                f"{statistics.median(res['step_ms']):.1f} ms",
                file=sys.stderr,
            )
    rows = []
    for t, n in configs:
        pooled = [x for r in runs[(t, n)] for x in r]
        rows.append(
            {
                "threads": t,
                "neighbours": n,
                "p50_ms": statistics.median(pooled),
                "p99_ms": _q(pooled, 0.99),
                "per_round_p50_ms": [statistics.median(r) for r in runs[(t, n)]],
                "steps": len(pooled),
            }
        )
    alone = {r["threads"]: r for r in rows if r["neighbours"] == 0}
    print(f"{'threads':>7} {'busy':>4} {'p50 ms':>8} {'p99 ms':>8} {'p50 x':>6} {'p99 x':>6}")
    for r in rows:
        a = alone.get(r["threads"])
        r["p50_x"] = r["p50_ms"] / a["p50_ms"] if a else None
        r["p99_x"] = r["p99_ms"] / a["p99_ms"] if a else None
        fx = lambda v: f"{v:6.2f}" if v is not None else "     -"  # noqa: E731
        print(
            f"{r['threads']:>7} {r['neighbours']:>4} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} "
            f"{fx(r['p50_x'])} {fx(r['p99_x'])}   rounds p50: "
            + " / ".join(f"{x:.1f}" for x in r["per_round_p50_ms"])
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "cores": os.cpu_count(), "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
