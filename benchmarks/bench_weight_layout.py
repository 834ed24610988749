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

import torch
from common import alternate_steps, decoding_engine
from torch import nn


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
    e = decoding_engine(batch, policy)
    layouts = _layouts([m for m in (e.target, e.draft) if m is not None])

    def use(pairs):
        def install():
            for mod, w in pairs:
                mod.weight = w

        return install

    try:
        ms = alternate_steps(e, {k: use(v) for k, v in layouts.items()}, rounds)
    finally:
        use(layouts["shipped"])()
        e.close()
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
