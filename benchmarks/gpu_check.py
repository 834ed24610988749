"""The engine on CUDA: speculative output against autoregressive output, shipped pair.

Run on a machine with a GPU (``benchmarks/gpu_run.sh`` runs it with the H200 profile):

    python benchmarks/gpu_check.py --out gpu_check.json [--dtype float32] [--policy NAME]

Greedy decoding of the same prompts with a speculative policy (``adaserve`` by default:
token trees drafted and verified on the GPU) and with ``ar``; writes how many outputs
match token for token, the tokens per step and the wall time of each. ``adaserve``
speculates only where its profile says it pays; a static tree (``--policy spec-tree``)
speculates on every step whatever the machine's speed (the CPU test uses it). Float32 by default: bf16 rounding can
flip a near-tie between a batched verification pass and a one-token decode pass, which
is a property of the arithmetic, not of speculation.
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Once upon a time, in a small village,",
    "import numpy as np\n\ndef softmax(x):",
    "Summarise the following text: The quick brown fox jumps over the lazy dog.",
    "Q: What is 12 times 7?\nA:",
    "class Stack:\n    def __init__(self):",
    "The three laws of thermodynamics are",
]


def run(policy: str, device: str, dtype: str, max_tokens: int) -> dict:
    from adaserve import LLM, SamplingParams

    llm = LLM(policy=policy, device=device, dtype=dtype)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[:2], sp)  # warm-up (allocator, kernels)
    t0 = time.perf_counter()
    outs = llm.generate(PROMPTS, sp, slo=["interactive", "chat"] * (len(PROMPTS) // 2))
    wall = time.perf_counter() - t0
    return {
        "policy": policy,
        "wall_s": wall,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "tokens_per_step": [o.metrics["tokens_per_step"] for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--policy", default="adaserve", help="the speculative policy")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    spec = run(a.policy, a.device, a.dtype, a.max_tokens)
    ar = run("ar", a.device, a.dtype, a.max_tokens)
    same = [x == y for x, y in zip(spec["tokens"], ar["tokens"])]
    first_diff = [
        next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        for x, y in zip(spec["tokens"], ar["tokens"])
    ]
    res = {
        "device": a.device,
        "dtype": a.dtype,
        "prompts": len(PROMPTS),
        "identical_outputs": sum(same),
        "first_difference_at": first_diff,
        "policy": a.policy,
        "speculative": {k: spec[k] for k in ("wall_s", "tokens_per_step")},
        "ar": {k: ar[k] for k in ("wall_s", "tokens_per_step")},
    }
    print(json.dumps(res, indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
