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

import torch
import torch.nn.functional as F
from common import alternate_steps, decoding_engine, run_cases

import adaserve.models.llama as llama


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
    e = decoding_engine(batch, policy)
    shipped = llama.paged_attention

    def use(fn):
        return lambda: setattr(llama, "paged_attention", fn)

    try:
        ms = alternate_steps(
            e, {"reference": use(reference_attention), "shipped": use(shipped)}, rounds
        )
    finally:
        llama.paged_attention = shipped
        e.close()
    return {"step_ms": ms, "speedup": round(ms["reference"] / ms["shipped"], 2)}


if __name__ == "__main__":
    run_cases(__doc__, "48:ar,8:spec-chain:4,1:ar", run_case)
