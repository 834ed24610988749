"""Engine step time with projection weights stored [in, out]-contiguous (as shipped on
CPU, ``LlamaModel.transpose_weights``) vs the row-major [out, in] layout.

Both layouts hold the same values; they are swapped in place on one engine every 6
steps, so machine-speed drift affects both alike. Prints mean step ms for each and the
ratio, per (batch, policy).

    .venv/bin/python benchmarks/bench_weight_layout.py [--cases 8:spec-chain:4,1:spec-chain:4,16:ar]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from common import heldout_code_prompts
from torch import nn

from adaserve.config import EngineConfig
from adaserve.engine import Engine
from adaserve.sampling import SamplingParams
from adaserve.slo import SLO


def _layouts(models) -> dict[str, list[tuple[nn.Linear, torch.Tensor]]]:
    """Per layout, (module, weight) pairs to install; same values in both."""
    shipped, rowmajor = [], []
    for m in models:
        for mod in m.modules():
            if isinstance(mod, nn.Linear):
                shipped.append((mod, mod.weight))
                rowmajor.append((mod, nn.Parameter(mod.weight.detach().contiguous(), False)))
    return {"row-major": rowmajor, "shipped": shipped}


def run_case(batch: int, policy: str, rounds: int) -> dict:
    e = Engine(EngineConfig(policy=policy))
    sp = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for p in heldout_code_prompts(batch, 400, 1600):
        e.add_request(e.tokenizer.encode(p), sp, SLO(tpot_ms=50))
    while e.waiting or any(r.num_output == 0 for r in e.running):
        e.step()
    layouts = _layouts([m for m in (e.target, e.draft) if m is not None])
    tot = dict.fromkeys(layouts, 0.0)
    try:
        for _ in range(rounds):
            for name, pairs in layouts.items():
                for mod, w in pairs:
                    mod.weight = w
                e.step()  # warm-up step for this layout
                t = time.perf_counter()
                for _ in range(5):
                    e.step()
                tot[name] += time.perf_counter() - t
    finally:
        for mod, w in layouts["shipped"]:
            mod.weight = w
        e.close()
    ms = {k: round(v / (5 * rounds) * 1e3, 2) for k, v in tot.items()}
    return {"step_ms": ms, "speedup": round(ms["row-major"] / ms["shipped"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="8:spec-chain:4,1:spec-chain:4,16:ar,1:ar")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    out = {}
    for case in args.cases.split(","):
        b, pol = case.split(":", 1)
        out[case] = run_case(int(b), pol, args.rounds)
        print(case, out[case], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
