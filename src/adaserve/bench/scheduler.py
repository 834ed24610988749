"""``adaserve bench scheduler``: time of one selection decision (plan + select)."""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from adaserve.core.policy import BatchView, ReqView
from adaserve.core.tree import CandidateTree
from adaserve.hardware.calibration import Calibrator
from adaserve.hardware.model import HardwareModel
from adaserve.policies.budgeted import AdaServePolicy

# the reference experiment's 70B target on 4 A100s (design note, section 6)
REFERENCE_HW = HardwareModel.from_dict(
    {
        "verify": {"tokens": [1, 128, 256, 512, 1024], "latency_ms": [40, 55, 85, 125, 205]},
        "draft_step_ms": 5.0,
    }
)


def beam_tree(rng: np.random.Generator, n: int, width: int = 4) -> CandidateTree:
    """A candidate tree of ``n`` nodes shaped like a width-``width`` beam expansion."""
    parents, depth, q, rank = [0], [0], [1.0], [0]
    frontier = [0]
    while len(parents) <= n:
        nxt = []
        for p in frontier:
            probs = np.sort(rng.dirichlet(np.ones(8)))[::-1][:width]
            for j in range(width):
                if len(parents) > n:
                    break
                parents.append(p)
                depth.append(depth[p] + 1)
                q.append(float(probs[j]))
                rank.append(j)
                nxt.append(len(parents) - 1)
        frontier = nxt[:width]
    t = CandidateTree(
        tokens=rng.integers(0, 32000, len(parents)),
        parents=np.array(parents),
        depth=np.array(depth),
        q=np.array(q),
        rank=np.array(rank),
        f=np.ones(len(parents)),
    )
    Calibrator().apply(t)
    return t


def run(args) -> int:
    rng = np.random.default_rng(0)
    n, m = args.requests, args.candidates
    k = getattr(args, "prefilling", 0)
    if not 0 <= k < n:
        print(f"error: --prefilling must be in [0, --requests) (got {k})", file=sys.stderr)
        return 2
    classes = [(30.0, 0), (50.0, 1), (150.0, 2)]
    reqs = []
    for i in range(n):
        tpot, rank = classes[int(rng.choice(3, p=[0.6, 0.2, 0.2]))]
        n_out = int(rng.integers(2, 200))
        reqs.append(
            ReqView(
                rid=i,
                cls=str(rank),
                tpot_ms=tpot,
                ttft_ms=None,
                n_out=n_out,
                decode_ms=(n_out - 1) * tpot * float(rng.uniform(0.8, 1.2)),
                waited_ms=0.0,
                prefill_left=0,
                context_len=int(rng.integers(100, 2000)),
                rank=rank,
            )
        )
    for r in reqs[n - k :]:  # batch prompts, far from their TTFT deadline
        r.prefill_left, r.n_out, r.decode_ms = int(rng.integers(500, 3000)), 0, 0.0
        r.ttft_ms, r.waited_ms, r.rank, r.tpot_ms = 30000.0, 1000.0, 2, 150.0
    view = BatchView(now_ms=0.0, requests=reqs, free_kv_slots=10**7, hw=REFERENCE_HW)
    trees = {i: beam_tree(rng, m) for i in range(n - k)}
    pol = AdaServePolicy()
    times, sizes = [], []
    plan_times = []
    for it in range(args.iterations + 5):
        t0 = time.perf_counter()
        plan = pol.plan(view)
        t1 = time.perf_counter()
        # measure selection at a full budget: every request holds m candidates and the
        # pass may verify up to 4 per request on average
        plan.budget = n + 4 * n
        sel = pol.select(view, plan, trees)
        t2 = time.perf_counter()
        if it >= 5:
            plan_times.append((t1 - t0) * 1000)
            times.append((t2 - t1) * 1000)
            sizes.append(sum(len(s) - 1 for s in sel.values()))
    out = {
        "p50_ms": round(float(np.percentile(times, 50)), 3),
        "p99_ms": round(float(np.percentile(times, 99)), 3),
        "requests": n,
        "prefilling": k,
        "candidates": m,
        "selected_nodes_mean": round(float(np.mean(sizes)), 1),
        "plan_p50_ms": round(float(np.percentile(plan_times, 50)), 3),
        "decision_p50_ms": round(float(np.percentile(np.add(times, plan_times), 50)), 3),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"selection over {n} requests x {m} candidates: p50 {out['p50_ms']} ms, "
            f"p99 {out['p99_ms']} ms ({out['selected_nodes_mean']} nodes selected); "
            f"planning p50 {out['plan_p50_ms']} ms; whole decision p50 {out['decision_p50_ms']} ms"
        )
    return 0
