"""Re-measure a pair's acceptance statistics over longer greedy continuations.

The shipped ``pair_stats.json`` measures the draft against the target's greedy
continuations of 64 tokens (``adaserve train``). The bench workload's outputs are longer
(up to 160 tokens), and agreement rises along a continuation (the small target's greedy
text grows repetitive): on the shipped pair, top-1 agreement is 0.76 over output tokens
0-31 and 0.84 over 96-127. So the simulator, calibrated on 64 tokens, accepts fewer of a
chain's drafts than the engine does on the bench workload. This script writes a stats
file whose acceptance fields (by rank, by depth) come from ``--new-tokens`` tokens of
continuation, everything else (the engine calibration table, the models' metadata)
copied from ``--base``, plus the agreement by output position.

With ``--position-only`` it keeps every field of ``--base`` and adds only the agreement by
32-token block of the continuation (``agreement_by_position``, over ``--new-tokens``
tokens), which the simulator's acceptance model follows along each request's output,
and the agreement right after a miss over the base's own span
(``agreement_after_miss``), which its regime chain is fitted to; the shipped file's were
written this way:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pair_stats.py --out /tmp/stats128.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pair_stats.py --position-only \
        --new-tokens 160 --out src/adaserve/assets/pair_stats.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from adaserve.models.loader import load_model
from adaserve.train import corpus, stats
from adaserve.util import paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="stats JSON to write")
    ap.add_argument("--model", default=str(paths.DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(paths.DEFAULT_DRAFT))
    ap.add_argument("--base", default=str(paths.DEFAULT_STATS), help="stats to copy the rest from")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument(
        "--position-only",
        action="store_true",
        help="keep --base's acceptance fields; add only the agreement by output position",
    )
    args = ap.parse_args()
    if min(args.new_tokens, args.prompts, args.prompt_tokens) < 1:
        ap.error("--new-tokens, --prompts and --prompt-tokens must be positive")
    tok_file = Path(args.model) / "tokenizer.json"
    if not tok_file.is_file():
        ap.error(f"{args.model} has no tokenizer.json")
    tok = Tokenizer.from_file(str(tok_file))
    target, draft = load_model(args.model), load_model(args.draft)
    texts = corpus.heldout_prompt_texts(corpus.load_split("heldout"), per_file=3)
    prompts = stats.heldout_prompts(tok, texts, args.prompts, args.prompt_tokens)
    pair = stats.pair_stats(target, draft, prompts, args.new_tokens)
    base = json.loads(Path(args.base).read_text())
    if args.position_only:
        span = int(base.get("new_tokens") or args.new_tokens)  # the per-depth stats' span
        short = stats.pair_stats(target, draft, prompts, span) if span != args.new_tokens else pair
        out = {
            **base,
            "agreement_after_miss": short["agreement_after_miss"],
            "agreement_by_position": pair["agreement_by_position"],
            "position_tokens": args.new_tokens,
            "position_source": f"benchmarks/pair_stats.py --position-only, {args.new_tokens} "
            f"new tokens of {args.prompts} held-out prompts",
        }
    else:
        out = {
            **base,
            **pair,
            "position_tokens": args.new_tokens,
            "acceptance_source": f"benchmarks/pair_stats.py, {args.new_tokens} new tokens",
        }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"greedy agreement {pair['greedy_agreement']:.3f} over {args.new_tokens} tokens "
        f"(base: {base.get('greedy_agreement', float('nan')):.3f} over "
        f"{base.get('new_tokens', '?')}); agreement by 32-token block of the continuation: "
        + ", ".join(f"{x:.3f}" for x in pair["agreement_by_position"])
        + f"; wrote {args.out}"
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
