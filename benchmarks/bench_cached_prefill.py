"""Does the hardware profile price a prefill over a cached prefix? (run alone)

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_cached_prefill.py

One sequence, a chunk of ``n`` new tokens attending ``ctx`` cached ones, timed with the
engine's forward (the shipped target, the engine's KV layout), against the profile's
prediction ``verify_latency(n, ctx + n, n * ctx)`` (its pair term prices the
attention of the new tokens over the cached ones). Rounds interleave the shapes so the machine's
drift spreads over all of them. Prints measured / predicted per shape.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from adaserve.engine.profile import load_or_profile
from adaserve.kv.cache import KVCache
from adaserve.models.attention import AttnMetadata, SeqSpec
from adaserve.models.loader import load_model
from adaserve.util import paths


def main() -> int:
    from adaserve.engine import Engine

    eng = Engine(policy="adaserve")
    hw = load_or_profile(eng, auto=True)
    model = load_model(paths.DEFAULT_TARGET, torch.device("cpu"), torch.float32, False)
    kv = KVCache(model.cfg, 4096, torch.device("cpu"), torch.float32)
    shapes = [(n, ctx) for n in (16, 64, 256) for ctx in (0, 256, 1024, 1792)]
    times: dict = {s: [] for s in shapes}

    def once(n: int, ctx: int) -> float:
        ids = torch.randint(0, model.cfg.vocab_size, (n,))
        seq = SeqSpec(list(range(ctx)), list(range(ctx, ctx + n)), list(range(ctx, ctx + n)))
        with torch.inference_mode():
            t0 = time.perf_counter()
            meta = AttnMetadata.build([seq], torch.device("cpu"), model.cfg.sliding_window)
            h = model(ids, meta, kv.layers)
            model.logits(h[-1:]).argmax(-1).tolist()
            return (time.perf_counter() - t0) * 1000

    for s in shapes:
        once(*s)
    for _ in range(7):
        for s in shapes:
            times[s].append(once(*s))
    print("| new tokens | cached | measured ms | profile ms | measured / profile |")
    print("|---|---|---|---|---|")
    for n, ctx in shapes:
        m = statistics.median(times[(n, ctx)])
        p = float(hw.verify_latency(n, ctx + n, n * ctx))
        print(f"| {n} | {ctx} | {m:.2f} | {p:.2f} | {m / p:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
