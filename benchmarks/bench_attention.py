"""Engine step time with the paged attention as shipped vs a plain reference version.

The reference gathers each request's K/V with advanced indexing and lets
``scaled_dot_product_attention`` expand the KV heads (``enable_gqa``); the shipped
``adaserve.models.attention.paged_attention`` gathers with ``index_select`` and, for
one-token decode, folds the query heads of a KV head into query rows. Both run in one
process on the same engine state, alternated every 6 steps, so machine-speed drift
affects both alike. Prints mean step ms for each and the ratio, per (batch, policy).

    .venv/bin/python benchmarks/bench_attention.py [--cases 48:ar,8:spec-chain:4,1:ar]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from common import heldout_code_prompts

import adaserve.models.llama as llama
from adaserve.config import EngineConfig
from adaserve.engine import Engine
from adaserve.sampling import SamplingParams
from adaserve.slo import SLO


def reference_attention(q, k_cache, v_cache, groups, scale):
    """q: [T, H, D]; caches: [slots, Hkv, D] -> [T, H, D] (straightforward version)."""
    T, H, D = q.shape
    out = torch.empty_like(q)
    for g in groups:
        R, Q = g.tok_idx.shape
        qg = q[g.tok_idx].transpose(1, 2)  # [R, H, Q, D]
        kg = k_cache[g.ctx_slots].transpose(1, 2)  # [R, Hkv, L, D]
        vg = v_cache[g.ctx_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=k_cache.shape[1] != H
        )
        out[g.out_idx] = o.transpose(1, 2).reshape(R * Q, H, D)[g.valid]
    return out


def run_case(batch: int, policy: str, rounds: int) -> dict:
    e = Engine(EngineConfig(policy=policy))
    sp = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for p in heldout_code_prompts(batch, 400, 1600):
        e.add_request(e.tokenizer.encode(p), sp, SLO(tpot_ms=50))
    while e.waiting or any(r.num_output == 0 for r in e.running):
        e.step()
    shipped = llama.paged_attention
    tot = {"reference": 0.0, "shipped": 0.0}
    try:
        for _ in range(rounds):
            for name, fn in (("reference", reference_attention), ("shipped", shipped)):
                llama.paged_attention = fn
                e.step()  # warm-up step for this variant
                t = time.perf_counter()
                for _ in range(5):
                    e.step()
                tot[name] += time.perf_counter() - t
    finally:
        llama.paged_attention = shipped
        e.close()
    ms = {k: round(v / (5 * rounds) * 1e3, 2) for k, v in tot.items()}
    return {"step_ms": ms, "speedup": round(ms["reference"] / ms["shipped"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="48:ar,8:spec-chain:4,1:ar", help="batch:policy,...")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    out = {}
    for case in args.cases.split(","):
        b, pol = case.split(":", 1)
        out[case] = run_case(int(b), pol, args.rounds)
        print(case, out[case], flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
