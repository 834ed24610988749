"""Fit the simulator's host-overhead model for this machine and add it to a profile.

The simulator prices an iteration with the profile's forward timings; the engine also
spends host time (Python per request, per draft step, per tree node) that a profile of
bare forwards does not see. This script runs the shipped pair in-process on a bench
workload for a few policies, records every iteration's measured time, the profile's
prediction for the same batch (computed the way ``adaserve simulate`` computes it) and
the policy's own decision time, and fits the remainder by non-negative least squares
against the features of ``adaserve.sim.pricing.HostOverhead``, plus speed factors on the
profile's timings: one for the target's cost beyond one token, one for its one-token
cost and one for the draft (a shared machine runs at a different speed than when it was
profiled, and not uniformly: in slow phases big passes slowed by 1.8x while one-token
passes kept their speed, which one factor for everything priced `ar` 13% too slow). It
writes the profile rescaled by those factors,
``"host_overhead"`` added and ``"unloaded_tpot_ms"`` (the original profile's, which the
engine's class targets are built on), which ``adaserve simulate --profile`` then uses. Compare
against real runs made right after the fit: the machine's speed drifts within minutes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fit_host_overhead.py \\
        --profile cpu_profile.json --out cpu_profile_host.json

Fit on a different seed than the one you compare on (default seed 100).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from adaserve.core.trace import DraftWork
from adaserve.sim.pricing import HostOverhead, forward_ms


def nnls(X: np.ndarray, y: np.ndarray, iters: int = 100) -> np.ndarray:
    """min ||X b - y|| subject to b >= 0 (Lawson-Hanson active set): X [m, k], y [m]."""
    k = X.shape[1]
    b = np.zeros(k)
    free = np.zeros(k, dtype=bool)
    for _ in range(iters):
        grad = X.T @ (y - X @ b)
        if free.all() or grad[~free].max(initial=-np.inf) <= 1e-10:
            break
        free[np.argmax(np.where(free, -np.inf, grad))] = True
        while True:
            z = np.zeros(k)
            z[free] = np.linalg.lstsq(X[:, free], y, rcond=None)[0]
            if z[free].min() > 0:
                b = z
                break
            neg = free & (z <= 0)
            alpha = np.min(b[neg] / (b[neg] - z[neg]))
            b = b + alpha * (z - b)
            free &= b > 1e-12
    return b


def _counts(tr) -> dict:
    """The iteration's work, from its ``StepTrace``: the draft's catch-up and frontier
    tokens per step, speculating requests, drafted and verified candidates, tokens and
    context of the verification pass."""
    return {
        "catchup": tr.draft.catchup,
        "steps": list(tr.draft.steps),
        "n_spec": len(tr.spec),
        "spec_steps": sum(d for d, _ in tr.spec.values()),
        "drafted": tr.draft.drafted,
        "prefill_tokens": sum(tr.prefill.values()),
        "kv": tr.kv_tokens,
        "requests": len(tr.prefill) + len(tr.decode),
        "verified": sum(tr.tree_nodes.values()),
        "v_tokens": tr.tokens,
    }


class Recorder:
    """Collects one row per engine iteration from its step traces."""

    def __init__(self, engine):
        self.engine = engine
        self.rows: list[dict] = []
        self.cur: dict = {}
        engine.on_step = self._on_step

    def wrap_policy(self) -> None:
        pol = self.engine.policy
        for name in ("plan", "select"):
            fn = getattr(pol, name)

            def timed(*a, _fn=fn, **k):
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.cur["policy_ms"] = (
                        self.cur.get("policy_ms", 0.0) + (time.perf_counter() - t) * 1e3
                    )

            setattr(pol, name, timed)

    def _on_step(self, engine, trace) -> None:
        c = _counts(trace)
        c["policy_ms"], self.cur = self.cur.get("policy_ms", 0.0), {}
        ms = forward_ms(engine.hw, c["v_tokens"], c["kv"], trace.draft)
        target_ms = forward_ms(engine.hw, c["v_tokens"], c["kv"], DraftWork())
        fixed = forward_ms(engine.hw, 1, 0, DraftWork())  # one token, no context
        x = HostOverhead.features(
            c["requests"],
            c.get("n_spec", 0),
            c.get("spec_steps", 0),
            c.get("drafted", 0),
            c["verified"],
        )
        measured = trace.duration_s * 1e3
        # the target's and the draft's forwards apart: the machine's speed moves the
        # compute-bound target and the overhead-bound one-layer draft differently
        self.rows.append(
            {
                # x[5] (HostOverhead's per_iteration, 1) is left out of the fit: the
                # fixed part's column is that constant times the profile's cost
                "x": [target_ms - fixed, fixed, ms - target_ms, *x],
                "y": measured - c.get("policy_ms", 0.0),
                "ms": measured,
            }
        )


def _rescale(prof: dict, s: float, s_fixed: float, s_draft: float) -> None:
    """Rescale the profile to the machine's speed during the fit (a shared machine
    drifts, and not uniformly): the target's cost beyond one token by s, its one-token
    cost (and the per-pass overhead) by s_fixed, the draft's by s_draft."""
    v = prof["verify"]
    toks = np.asarray(v["tokens"], dtype=float)
    lat = np.asarray(v["latency_ms"], dtype=float)
    one = float(np.interp(1.0, toks, lat))
    v["latency_ms"] = [s_fixed * one + s * (x - one) for x in lat.tolist()]
    v["kv_ms_per_token"] = v.get("kv_ms_per_token", 0.0) * s
    if prof.get("draft_step"):
        prof["draft_step"]["latency_ms"] = [x * s_draft for x in prof["draft_step"]["latency_ms"]]
    if "draft_step_ms" in prof:
        prof["draft_step_ms"] *= s_draft
    prof["overhead_ms"] = prof.get("overhead_ms", 0.0) * s_fixed
    prof["speed_factor"] = s
    prof["fixed_speed_factor"] = s_fixed
    prof["draft_speed_factor"] = s_draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="profile JSON (adaserve profile)")
    ap.add_argument("--out", required=True, help="profile JSON to write, with host_overhead")
    ap.add_argument("--policies", default="ar,spec-chain:4,adaserve")
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--request-rate", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--kv-cache-bytes", default=None, help="e.g. 512M (as the runs compared)")
    ap.add_argument("--rows", help="also write every iteration's features and time here")
    args = ap.parse_args()

    from adaserve.bench.runner import EngineFactory, run_in_process
    from adaserve.bench.workload import build_workload
    from adaserve.bench.workload_spec import WorkloadSpec
    from adaserve.config import EngineConfig
    from adaserve.util.cli_args import byte_size as _bytes

    kv = _bytes(args.kv_cache_bytes) if args.kv_cache_bytes else None
    factory = EngineFactory(EngineConfig(profile=args.profile, kv_cache_bytes=kv))
    spec = WorkloadSpec(seed=args.seed, request_rate=args.request_rate, duration_s=args.duration)
    names = args.policies.split(",")
    engine = factory(names[0])
    items = build_workload(
        spec, tokenizer=engine.tokenizer, vocab_size=engine.target.cfg.vocab_size
    )
    rec = Recorder(engine)

    def make(policy: str):
        eng = factory(policy)  # the same engine, with this policy
        rec.wrap_policy()
        return eng

    spans = {}
    for pol in names:
        start = len(rec.rows)
        run_in_process(make, pol, items, spec, progress=False)
        spans[pol] = (start, len(rec.rows))
        ms = [r["ms"] for r in rec.rows[start:]]
        print(f"{pol}: {len(ms)} iterations, mean {np.mean(ms):.1f} ms", flush=True)
    rows = rec.rows
    X = np.array([r["x"][:3] + r["x"][4:] for r in rows])  # without per_iteration
    y = np.array([r["y"] for r in rows])
    b = nnls(X, y)
    names = [f.name for f in dataclasses.fields(HostOverhead)]  # the x columns' order
    speed, s_fixed, s_draft = float(b[0]), float(b[1]), float(b[2])
    fit = dict(zip(names[1:], (round(float(v), 4) for v in b[3:])))
    fit = {names[0]: 0.0, **fit}
    resid = y - X @ b
    print(
        f"speed factor (this run / the profile): {speed:.3f} beyond one token, "
        f"{s_fixed:.3f} for one token, draft {s_draft:.3f}"
    )
    print("host overhead (ms):", fit)
    print(f"residual: mean {resid.mean():.2f} ms, MAE {np.abs(resid).mean():.2f} ms")
    for pol, (a, z) in spans.items():
        r, m = resid[a:z], y[a:z]
        print(f"  {pol}: mean residual {r.mean():+.2f} ms ({100 * r.mean() / m.mean():+.1f}%)")
    prof = json.loads(Path(args.profile).read_text())
    # the engine builds the class targets on the profile it was given: keep that base
    prof["unloaded_tpot_ms"] = engine.hw.unloaded_tpot_ms()
    _rescale(prof, speed, s_fixed, s_draft)
    prof["host_overhead"] = fit
    Path(args.out).write_text(json.dumps(prof, indent=1) + "\n")
    if args.rows:
        cols = ["target_beyond_one_ms", "target_one_ms", "draft_ms", *names]
        pols = [p for p, (a, z) in spans.items() for _ in range(a, z)]
        Path(args.rows).write_text(
            json.dumps({"columns": cols, "policy": pols, "rows": rows}) + "\n"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
