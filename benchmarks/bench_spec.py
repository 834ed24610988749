"""Speculative decoding on the shipped pair, one run:

* single request, greedy, 256 new tokens: best static tree vs ``ar`` (this engine) and
  vs transformers assisted generation (``generate(assistant_model=draft)``);
* batch 8 and 32: speculation vs ``ar``.

    .venv/bin/python benchmarks/bench_spec.py [--new-tokens 256]
"""

from __future__ import annotations

import argparse
import json

import torch
from common import Timer, heldout_code_prompts

from adaserve import LLM, SamplingParams
from adaserve.util.paths import DEFAULT_DRAFT, DEFAULT_TARGET

STATIC = ["spec-chain:4", "spec-chain:6", "spec-tree:4x2", "spec-tree:5x3", "spec-tree:6x2:12"]


def rate(llm, prompts, n):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    with Timer() as t:
        outs = llm.generate(prompts, sp)
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = sum(o.metrics["steps"] for o in outs)
    return toks / t.s, toks / max(steps, 1), [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args()
    n = args.new_tokens
    prompts = heldout_code_prompts(32, 150, 800)
    res: dict = {"single": {}, "batch": {}}
    ar = LLM(policy="ar", no_draft=True)
    rate(ar, prompts[:1], 8)
    base, _, ref = rate(ar, prompts[:1], n)
    res["single"]["ar"] = round(base, 1)
    best = ("", 0.0)
    for pol in STATIC + ["adaserve"]:
        llm = LLM(policy=pol, draft=str(DEFAULT_DRAFT), model=str(DEFAULT_TARGET))
        rate(llm, prompts[:1], 8)
        r, tps, out = rate(llm, prompts[:1], n)
        assert out == ref, f"{pol} changed the greedy output"
        res["single"][pol] = {
            "tok_s": round(r, 1),
            "tokens_per_step": round(tps, 2),
            "speedup_vs_ar": round(r / base, 2),
        }
        if pol in STATIC and r > best[1]:
            best = (pol, r)
    from transformers import AutoModelForCausalLM

    hf_t = AutoModelForCausalLM.from_pretrained(
        str(DEFAULT_TARGET), torch_dtype=torch.float32
    ).eval()
    hf_d = AutoModelForCausalLM.from_pretrained(
        str(DEFAULT_DRAFT), torch_dtype=torch.float32
    ).eval()
    ids = torch.tensor([ar.tokenizer.encode(prompts[0])])
    with torch.inference_mode(), Timer() as t:
        out = hf_t.generate(
            ids, assistant_model=hf_d, max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    hf_rate = (out.shape[1] - ids.shape[1]) / t.s
    res["single"]["transformers_assisted_tok_s"] = round(hf_rate, 1)
    res["single"]["best_static"] = best[0]
    res["single"]["best_static_vs_ar"] = round(best[1] / base, 2)
    res["single"]["best_static_vs_transformers_assisted"] = round(best[1] / hf_rate, 2)
    for bs in (8, 32):
        p = prompts[:bs]
        a, _, _ = rate(ar, p, 128)
        row = {"ar_tok_s": round(a, 1)}
        for pol in (best[0], "adaserve"):
            llm = LLM(policy=pol)
            r, tps, _ = rate(llm, p, 128)
            row[pol] = {
                "tok_s": round(r, 1),
                "vs_ar": round(r / a, 2),
                "tokens_per_step": round(tps, 2),
            }
        res["batch"][f"batch{bs}"] = row
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
