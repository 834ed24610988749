"""Where an engine step's time goes on a GPU: cProfile and torch.profiler over a few
autoregressive decode steps of one request (diagnosis for benchmarks/gpu_run.sh).

    python benchmarks/gpu_step_profile.py --shapes Llama-3.1-8B --dtype bfloat16
    python benchmarks/gpu_step_profile.py --dtype float32      # the shipped target
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None, help="random-weight model shape (sim presets)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    import torch

    from adaserve.cli import _shape_dirs
    from adaserve.config import EngineConfig
    from adaserve.engine import build_engine
    from adaserve.sampling import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model = _shape_dirs(a.shapes, tmp)[0] if a.shapes else None
        eng = build_engine(
            EngineConfig(
                model=model,
                no_draft=True,
                policy="ar",
                device=a.device,
                dtype=a.dtype,
                auto_profile=False,
                kv_cache_bytes=1 << 30,
                random_weights=a.shapes is not None,
            )
        )
    sp = SamplingParams(temperature=0.0, max_tokens=10 * a.steps + 20, ignore_eos=True)
    r = eng.add_request(list(range(1, 33)), sp)
    for _ in range(6):
        eng.step()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t0) * 1000)
    print(f"step ms: {' '.join(f'{t:.2f}' for t in times)}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.steps):
        eng.step()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.top)
    print(s.getvalue())
    acts = [torch.profiler.ProfilerActivity.CPU]
    if a.device.startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.steps):
            eng.step()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=a.top))
    if a.device.startswith("cuda"):
        print(ka.table(sort_by="self_cuda_time_total", row_limit=12))
    assert not r.finished


if __name__ == "__main__":
    main()
