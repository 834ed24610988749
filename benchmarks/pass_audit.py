"""Where the engine's passes lose time against the profile.

Runs the shipped pair in process on a bench workload and times every forward pass of
the target (verification) and the draft as it ran in the serving loop, then re-runs the
same pass at once, back to back, on a shadow KV cache with the same metadata (the same
tokens, slots, masks and attention groups: the same shapes and kernels, a cost that does
not depend on the cache's values), and prices it by the profile
(``HardwareModel.verify_latency`` / ``draft_latency`` with their context terms).

    in the loop / back to back   > 1: the serving loop's state slows the same pass
                                 (caches evicted by host work between passes)
    back to back / profile       > 1: the profile's synthetic shapes (8 equal sequences,
                                 contiguous slots) price the real shapes too cheaply

Run it alone on the machine:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pass_audit.py --policies adaserve,ar \\
        --request-rate 4 --duration 10 --class-mix interactive:0.3,chat:0.2,batch:0.5
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


class Audit:
    """Forward hooks on a model: each call's time in the loop and its back-to-back
    re-run on ``shadow`` KV layers, with the call's token and context counts."""

    def __init__(self, model, shadow_layers, name: str):
        self.model, self.shadow, self.name = model, shadow_layers, name
        self.rows: list[tuple[int, int, float, float]] = []  # tokens, context, ms, ms
        self._t0 = 0.0
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _pre(self, module, args):
        self._t0 = time.perf_counter()

    def _post(self, module, args, out):
        loop_ms = (time.perf_counter() - self._t0) * 1000
        ids, meta = args[0], args[1]
        t0 = time.perf_counter()
        with torch.inference_mode():
            module.forward(ids, meta, self.shadow)
        again_ms = (time.perf_counter() - t0) * 1000
        self.rows.append((int(ids.numel()), int(meta.audit_kv), loop_ms, again_ms))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="adaserve,ar")
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--class-mix", default="interactive:0.3,chat:0.2,batch:0.5")
    args = ap.parse_args()

    from adaserve.bench.runner import EngineFactory, run_in_process
    from adaserve.bench.workload import build_workload
    from adaserve.bench.workload_spec import WorkloadSpec, parse_class_mix
    from adaserve.config import EngineConfig
    from adaserve.kv.cache import KVCache
    from adaserve.models import attention

    # every AttnMetadata built remembers its context tokens (the prefix slots attended)
    build = attention.AttnMetadata.build.__func__

    def counted(cls, seqs, device, sliding_window=None):
        meta = build(cls, seqs, device, sliding_window)
        meta.audit_kv = sum(len(s.prefix_slots) for s in seqs)
        return meta

    attention.AttnMetadata.build = classmethod(counted)

    factory = EngineFactory(EngineConfig())
    spec = WorkloadSpec(
        seed=args.seed,
        request_rate=args.request_rate,
        duration_s=args.duration,
        class_mix=parse_class_mix(args.class_mix),
    )
    names = args.policies.split(",")
    engine = factory(names[0])
    hw = engine.hw
    items = build_workload(
        spec, tokenizer=engine.tokenizer, vocab_size=engine.target.cfg.vocab_size
    )
    audits = []
    for model, kv, name in ((engine.target, engine.kv_target, "target"),
                            (engine.draft, engine.kv_draft, "draft")):  # fmt: skip
        if model is None:
            continue
        shadow = KVCache(model.cfg, kv.num_slots, model.embed_tokens.weight.device,
                         model.embed_tokens.weight.dtype)  # fmt: skip
        audits.append(Audit(model, shadow.layers, name))
    print(f"profile: {hw.source}")
    for pol in names:
        marks = [len(a.rows) for a in audits]
        run_in_process(factory, pol, items, spec, progress=False)
        for a, m in zip(audits, marks):
            rows = a.rows[m:]
            if not rows:
                continue
            price = hw.verify_latency if a.name == "target" else hw.draft_latency
            per_kv = hw.kv_ms_per_token if a.name == "target" else hw.draft_kv_ms_per_token
            prof = np.array([float(price(t)) + per_kv * kv for t, kv, _, _ in rows])
            loop = np.array([r[2] for r in rows])
            again = np.array([r[3] for r in rows])
            tok = np.array([r[0] for r in rows])
            print(f"{pol} {a.name}: {len(rows)} passes; summed ms: in the loop {loop.sum():.0f}, "
                  f"back to back {again.sum():.0f}, profile {prof.sum():.0f}")  # fmt: skip
            print(f"   in the loop / back to back {loop.sum() / again.sum():.3f} "
                  f"(median {statistics.median(loop / again):.3f}); back to back / profile "
                  f"{again.sum() / prof.sum():.3f} (median {statistics.median(again / prof):.3f})")  # fmt: skip
            for lo, hi in ((1, 16), (17, 64), (65, 256), (257, 10**6)):
                m = (tok >= lo) & (tok <= hi)
                if m.any():
                    print(f"   {lo}-{hi} tokens: {int(m.sum())} passes, back to back / profile "
                          f"{again[m].sum() / prof[m].sum():.3f}, loop / back to back "
                          f"{loop[m].sum() / again[m].sum():.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
