"""Engine step time with projection weights stored [in, out]-contiguous (as shipped on
CPU, ``LlamaModel.transpose_weights``) vs the row-major [out, in] layout.

Both layouts hold the same values; they are swapped in place on one engine every 6
steps, so machine-speed drift affects both alike. Prints mean step ms for each and the
ratio, per (batch, policy).

    .venv/bin/python benchmarks/bench_weight_layout.py [--cases 8:spec-chain:4,1:spec-chain:4,16:ar]
"""

from __future__ import annotations

import torch
from common import alternate_steps, decoding_engine, run_cases
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


if __name__ == "__main__":
    run_cases(__doc__, "8:spec-chain:4,1:spec-chain:4,16:ar,1:ar", run_case)
