"""Autoregressive decode: adaserve vs transformers ``generate``, same model, one run.

    .venv/bin/python benchmarks/bench_engine_vs_hf.py [--model DIR] [--new-tokens 128]

Prints tokens/s of both at batch 1 and batch 16 (mixed prompt lengths) and the ratios.
"""

from __future__ import annotations

import argparse
import json

import torch
from common import Timer, heldout_code_prompts

from adaserve import LLM, SamplingParams
from adaserve.util.paths import DEFAULT_TARGET


def hf_tokens_per_s(hf, tok, prompts, new_tokens):
    ids = [tok.encode(p) for p in prompts]
    L = max(len(x) for x in ids)
    pad = 0
    input_ids = torch.tensor([[pad] * (L - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in ids])
    with torch.inference_mode(), Timer() as t:
        out = hf.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    n = (out.shape[1] - L) * len(prompts)
    return n / t.s


def ours_tokens_per_s(llm, prompts, new_tokens):
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    with Timer() as t:
        outs = llm.generate(prompts, sp)
    return sum(len(o.outputs[0].token_ids) for o in outs) / t.s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    llm = LLM(model=args.model, no_draft=True, policy="ar")
    tok = llm.tokenizer
    prompts = heldout_code_prompts(16, 100, 1500)
    ours_tokens_per_s(llm, prompts[:2], 8)  # warm up both
    hf_tokens_per_s(hf, tok, prompts[:1], 8)
    res = {}
    for bs in (1, 16):
        p = prompts[:bs]
        h = hf_tokens_per_s(hf, tok, p, args.new_tokens)
        o = ours_tokens_per_s(llm, p, args.new_tokens)
        res[f"batch{bs}"] = {
            "adaserve_tok_s": round(o, 1),
            "transformers_tok_s": round(h, 1),
            "ratio": round(o / h, 2),
        }
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
