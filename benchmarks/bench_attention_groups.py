"""Attention groups, measured: one forward of the shipped target over a batch of short
query runs (decodes, token trees) as one padded group against the batch split by
``attention._partition`` at several group costs (``GROUP_COST_PAIRS``; inf = one group).
Run alone:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_attention_groups.py
"""

import random
import statistics
import time

import torch

from adaserve.kv.cache import KVCache
from adaserve.models import attention as A
from adaserve.models.attention import AttnMetadata, SeqSpec
from adaserve.models.loader import load_model
from adaserve.util import paths

torch.manual_seed(0)
random.seed(0)
model = load_model(paths.DEFAULT_TARGET, torch.device("cpu"), torch.float32, False)
kv = KVCache(model.cfg, 40000, torch.device("cpu"), torch.float32)


def batch(qs, ls):
    seqs, base = [], 0
    for q, c in zip(qs, ls):
        seqs.append(
            SeqSpec(
                list(range(base, base + c)),
                list(range(base + c, base + c + q)),
                list(range(c, c + q)),
            )
        )
        base += c + q
    return seqs


def time_it(seqs, cost, reps=7):
    A.GROUP_COST_PAIRS = cost
    T = sum(len(s.new_slots) for s in seqs)
    ids = torch.randint(0, model.cfg.vocab_size, (T,))
    ts = []
    for _ in range(reps + 1):
        with torch.inference_mode():
            t0 = time.perf_counter()
            meta = AttnMetadata.build(seqs, torch.device("cpu"), None)
            h = model(ids, meta, kv.layers)
            model.logits(h[-len(seqs) :]).argmax(-1).tolist()
            ts.append((time.perf_counter() - t0) * 1000)
    return statistics.median(ts[1:]), len(meta.groups)


cases = {
    "uniform chains (16 x q5, ctx 300-700)": (
        [5] * 16,
        [random.randint(300, 700) for _ in range(16)],
    ),
    "mixed-trees (16, q 1..32, ctx 100-1500)": (
        [1, 1, 1, 1, 2, 3, 5, 5, 8, 8, 12, 16, 16, 24, 32, 32],
        [random.randint(100, 1500) for _ in range(16)],
    ),
    "roots + trees (24, q 1/16, ctx 200-900)": (
        [1] * 16 + [16] * 8,
        [random.randint(200, 900) for _ in range(24)],
    ),
    "decode only (32 x q1, ctx 100-1500)": (
        [1] * 32,
        [random.randint(100, 1500) for _ in range(32)],
    ),
}
for name, (qs, ls) in cases.items():
    seqs = batch(qs, ls)
    res = {c: time_it(seqs, c) for c in (10**12, 2048, 512, 0)}
    print(
        name,
        " | ".join(
            f"C={c if c < 10**12 else 'inf'}: {ms:.1f} ms ({g} groups)"
            for c, (ms, g) in res.items()
        ),
    )
