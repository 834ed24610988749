"""Penalties under speculation on the shipped pair: greedy output with penalties equal
to plain decoding's, and the draft's acceptance with and without the draft penalising
its own proposals (the verifier always penalises; only acceptance can change).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_penalties.py [--prompts 16] [--new-tokens 48]

Prints one JSON object: per policy, accepted / drafted candidates and tokens per step,
with the draft penalised (as shipped) and not (the draft's penalties switched off).
"""

from __future__ import annotations

import argparse
import json

from common import heldout_code_prompts

import adaserve.spec_decode.draft as draft_mod
from adaserve import LLM, SamplingParams
from adaserve.core.clock import TickClock

PEN = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)


def run(policy: str, prompts, sp) -> tuple[list[list[int]], dict]:
    llm = LLM(policy=policy, no_draft=policy == "ar", clock=TickClock(0.001))
    outs = llm.generate(prompts, sp, use_tqdm=False)
    c = llm.engine.counters
    steps = sum(o.metrics["steps"] for o in outs)
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = {
        "accepted": c.spec_accepted_tokens,
        "drafted": c.spec_draft_tokens,
        "acceptance": round(c.spec_accepted_tokens / max(c.spec_draft_tokens, 1), 3),
        "tokens_per_step": round(toks / max(steps, 1), 3),
    }
    return [o.outputs[0].token_ids for o in outs], stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    prompts = heldout_code_prompts(args.prompts, 150, 800)
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, **PEN)
    ref, _ = run("ar", prompts, sp)
    plain, _ = run(
        "ar", prompts, SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    )
    res: dict = {"penalties": PEN, "changed_by_penalties": sum(a != b for a, b in zip(ref, plain))}
    shipped = draft_mod._penalised
    for policy in ("spec-chain:4", "spec-tree:4x2"):
        for name, fn in (("draft penalised", shipped), ("draft not penalised", None)):
            draft_mod._penalised = fn or (lambda logits, *a: logits)
            try:
                got, stats = run(policy, prompts, sp)
            finally:
                draft_mod._penalised = shipped
            stats["equal_to_plain_decoding"] = got == ref
            res.setdefault(policy, {})[name] = stats
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
