"""``adaserve train``: train the default target/draft pair reproducibly.

    adaserve train --out DIR [--minutes N] [--seed S] [--target-minutes-share F] [--smoke]

Writes ``DIR/target/`` and ``DIR/draft/`` (Hugging Face Llama checkpoints with
tokenizer, generation config and a model card) and ``DIR/pair_stats.json``. Training
state lives in ``DIR/.ckpt/``; rerunning the same command resumes from it.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from adaserve.models.loader import load_model, save_pretrained
from adaserve.train import corpus, stats, tokenizer, trainer
from adaserve.util import cli_args

SIZE_LIMIT_BYTES = 48 * 1024 * 1024  # store fp32 only when both models fit comfortably


def _parser() -> argparse.ArgumentParser:
    p = cli_args.Parser(
        prog="adaserve train",
        description="Train the default target/draft model pair on the Python standard library.",
    )
    p.add_argument(
        "--out", required=True, help="output directory (target/, draft/, pair_stats.json)"
    )
    p.add_argument(
        "--minutes",
        type=cli_args.positive_float,
        default=None,
        help="total training minutes (default 56; smoke 0.1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--target-minutes-share",
        type=float,
        default=0.72,
        help="fraction of the minutes spent on the target; the rest trains and distils the draft",
    )
    p.add_argument("--smoke", action="store_true", help="tiny models, a few seconds (for tests)")
    p.add_argument(
        "--threads", type=cli_args.int_at_least(1), default=2, help="torch CPU threads (default 2)"
    )
    p.add_argument(
        "--vocab-size", type=int, default=None, help="BPE vocabulary (default 4096; smoke 512)"
    )
    p.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="matmul precision while training (master weights stay fp32); auto = bf16 "
        "autocast when the CPU has native bf16 (AVX512/AMX), else fp32",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not 0.0 < args.target_minutes_share < 1.0:
        print("adaserve train: --target-minutes-share must be in (0, 1)", file=sys.stderr)
        return 2
    minutes = args.minutes if args.minutes is not None else (0.1 if args.smoke else 56.0)
    if minutes <= 0:
        print("adaserve train: --minutes must be positive", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, args.threads))
    command = "adaserve train " + shlex.join(sys.argv[1:] if argv is None else argv)
    run(
        out=Path(args.out),
        minutes=minutes,
        seed=args.seed,
        share=args.target_minutes_share,
        smoke=args.smoke,
        vocab_size=args.vocab_size or (512 if args.smoke else 4096),
        progress=not args.no_progress,
        command=command,
        bf16=args.precision == "bf16" or (args.precision == "auto" and trainer.bf16_is_fast()),
    )
    return 0


def _log(msg: str) -> None:
    print(f"[adaserve train {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(
    out: Path,
    minutes: float,
    seed: int,
    share: float,
    smoke: bool,
    vocab_size: int,
    progress: bool,
    command: str,
    bf16: bool = False,
) -> dict:
    t0 = time.perf_counter()
    ckpt = out / ".ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    every = 25 if smoke else 1
    train_files = corpus.load_split("train", every=every)
    heldout_files = corpus.load_split("heldout", every=4 if smoke else 1)
    _log(
        f"corpus: {len(train_files)} train / {len(heldout_files)} held-out files under {corpus.stdlib_root()}"
    )

    tok_file = ckpt / "tokenizer.json"
    if tok_file.is_file():
        tok = tokenizer.load_tokenizer(tok_file)
    else:
        tok = tokenizer.train_tokenizer((f.text for f in train_files), vocab_size)
        tok.save(str(tok_file))
    eos = tokenizer.eos_id(tok)
    vocab = tok.get_vocab_size()
    tok_cache = ckpt / "tokens.pt"
    if tok_cache.is_file():
        streams = torch.load(tok_cache)
    else:
        streams = {
            "train": tokenizer.token_stream(tok, [f.text for f in train_files]),
            "heldout": tokenizer.token_stream(tok, [f.text for f in heldout_files]),
        }
        torch.save(streams, tok_cache)
    train_stream, heldout_stream = streams["train"], streams["heldout"]
    _log(f"tokens: {train_stream.numel()} train / {heldout_stream.numel()} held-out, vocab {vocab}")

    t_spec = trainer.SMOKE_TARGET_SPEC if smoke else trainer.TARGET_SPEC
    d_spec = trainer.SMOKE_DRAFT_SPEC if smoke else trainer.DRAFT_SPEC
    t_cfg = trainer.hf_config(t_spec, vocab, eos)
    d_cfg = trainer.hf_config(d_spec, vocab, eos)
    total_s = minutes * 60.0
    target_s = total_s * share
    draft_ce_s = (total_s - target_s) * 0.3
    draft_kl_s = total_s - target_s - draft_ce_s
    if smoke:
        t_phase = trainer.PhaseConfig("target", target_s, 2, 64, 3e-3, bf16=bf16, ckpt_every_s=1.0)
        d_ce = trainer.PhaseConfig("draft_ce", draft_ce_s, 2, 64, 3e-3, bf16=bf16, ckpt_every_s=1.0)
        d_kl = trainer.PhaseConfig(
            "draft_kl", draft_kl_s, 2, 64, 2e-3, kind="kl", bf16=bf16, ckpt_every_s=1.0
        )
        eval_seq, eval_n = 64, 4
    else:
        t_phase = trainer.PhaseConfig("target", target_s, 4, 512, 2e-3, bf16=bf16)
        d_ce = trainer.PhaseConfig("draft_ce", draft_ce_s, 8, 256, 3e-3, bf16=bf16)
        d_kl = trainer.PhaseConfig("draft_kl", draft_kl_s, 4, 512, 2e-3, kind="kl", bf16=bf16)
        eval_seq, eval_n = 512, 64
    windows = trainer.eval_windows(heldout_stream, eval_seq, eval_n)

    target = trainer.build_model(t_cfg, seed)
    draft = trainer.build_model(d_cfg, seed + 1)
    n_bytes = 4 * (trainer.num_params(target) + trainer.num_params(draft))
    dtype = torch.float32 if n_bytes <= SIZE_LIMIT_BYTES else torch.bfloat16
    gen_cfg = {
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "do_sample": False,
        "max_new_tokens": 128,
    }
    target_dir, draft_dir = out / "target", out / "draft"

    _log(f"target: {trainer.num_params(target):,} params, {t_phase.budget_s:.0f}s")
    t_sum = trainer.train_phase(target, train_stream, t_phase, ckpt, seed, progress_bar=progress)
    save_pretrained(target, target_dir, t_cfg, dtype, gen_cfg)
    tokenizer.save_tokenizer(tok, target_dir)
    target = load_model(target_dir)  # evaluate exactly what ships (fp32 compute)
    t_loss = trainer.heldout_loss(target, windows)
    _log(f"target held-out loss {t_loss:.3f} nats/token")

    _log(
        f"draft: {trainer.num_params(draft):,} params, {d_ce.budget_s:.0f}s CE + {d_kl.budget_s:.0f}s KL"
    )
    d_ce_sum = trainer.train_phase(draft, train_stream, d_ce, ckpt, seed + 1, progress_bar=progress)
    d_loss_ce = trainer.heldout_loss(draft, windows)
    d_kl_sum = trainer.train_phase(
        draft, train_stream, d_kl, ckpt, seed + 2, teacher=target, progress_bar=progress
    )
    save_pretrained(draft, draft_dir, d_cfg, dtype, gen_cfg)
    tokenizer.save_tokenizer(tok, draft_dir)
    draft = load_model(draft_dir)
    d_loss = trainer.heldout_loss(draft, windows)
    _log(f"draft held-out loss {d_loss:.3f} (after CE only: {d_loss_ce:.3f})")

    n_prompts, p_len, n_new = (4, 16, 16) if smoke else (64, 64, 64)
    texts = corpus.heldout_prompt_texts(heldout_files, per_file=3)
    prompts = stats.heldout_prompts(tok, texts, n_prompts, p_len)
    pair = stats.pair_stats(target, draft, prompts, n_new)
    _log(f"greedy agreement {pair['greedy_agreement']:.3f}")
    reps = 5 if smoke else 60
    t_cost = stats.forward_costs(target, repeats=reps)
    d_cost = stats.forward_costs(draft, repeats=reps)
    sample_ids = stats.greedy_generate(target, prompts[:1], 16 if smoke else 160)[0].tolist()
    sample = (
        tok.decode(prompts[0].tolist(), skip_special_tokens=False),
        tok.decode(sample_ids, skip_special_tokens=False),
    )

    def info(model, spec, loss, cost, d) -> dict:
        return {
            "path": d.name,
            "parameters": trainer.num_params(model),
            "layers": spec.num_layers,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "heads": spec.num_heads,
            "kv_heads": spec.num_kv_heads,
            "heldout_loss": round(loss, 4),
            "weights_dtype": str(dtype).removeprefix("torch."),
            "weights_bytes": (d / "model.safetensors").stat().st_size,
            **cost,
        }

    def strip(s: dict) -> dict:
        return {k: v for k, v in s.items() if k != "loss_history"}

    calib = stats.engine_calibration(
        target_dir,
        draft_dir,
        [p.tolist() for p in prompts[: 8 if smoke else 24]],
        8 if smoke else 48,
    )
    _log(f"engine calibration: acceptance by rank {calib['acceptance_by_rank'][:3]}")
    result = {
        "format": 1,
        **pair,
        "calibration": calib,
        "target": info(target, t_spec, t_loss, t_cost, target_dir),
        "draft": info(draft, d_spec, d_loss, d_cost, draft_dir),
        "draft_heldout_loss_before_distillation": round(d_loss_ce, 4),
        "decode_cost_ratio": round(t_cost["decode_1_ms"] / d_cost["decode_1_ms"], 2),
        "target_verify16_over_decode1": round(t_cost["verify_16_ms"] / t_cost["decode_1_ms"], 2),
        "training": {
            "command": command,
            "minutes": minutes,
            "seed": seed,
            "smoke": smoke,
            "phases": [strip(t_sum), strip(d_ce_sum), strip(d_kl_sum)],
            "wall_seconds": round(time.perf_counter() - t0, 1),  # this invocation
            "training_seconds": round(sum(p["seconds"] for p in (t_sum, d_ce_sum, d_kl_sum)), 1),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "bf16_autocast": bf16,
            "machine": platform.machine(),
        },
        "corpus": {
            "source": f"Python {platform.python_version()} standard library (.py files)",
            "train_files": len(train_files),
            "heldout_files": len(heldout_files),
            "train_tokens": int(train_stream.numel()),
            "heldout_tokens": int(heldout_stream.numel()),
            "vocab_size": vocab,
            "heldout_rule": "sha1(relative path) % 20 == 0",
            "excluded_dirs": sorted(corpus.EXCLUDED_DIRS),
        },
    }
    (out / "pair_stats.json").write_text(json.dumps(result, indent=2) + "\n")
    _write_card(target_dir, "target", result, sample)
    _write_card(draft_dir, "draft", result, sample)
    _log(f"done in {result['training']['wall_seconds']:.0f}s -> {out}")
    return result


def _write_card(d: Path, role: str, r: dict, sample: tuple[str, str]) -> None:
    m = r[role]
    c = r["corpus"]
    tr = r["training"]
    phases = "\n".join(
        f"| {p['phase']} | {p['kind']} | {p['seconds']:.0f} | {p['steps']} | {p['tokens']:,} "
        f"| {p['batch']}x{p['seq']} | {p['peak_lr']} | {p['final_train_loss_ema']} |"
        for p in tr["phases"]
    )
    depth = ", ".join(f"{x:.3f}" for x in r["acceptance_by_depth"])
    rank = ", ".join(f"{x:.3f}" for x in r["acceptance_by_rank"])
    purpose = (
        "the **target** (verifier) of adaserve's default speculative-decoding pair"
        if role == "target"
        else "the **draft** (speculator) of adaserve's default speculative-decoding pair, "
        "trained on the data briefly and then distilled from the target's logits"
    )
    fence = "```"
    text = f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [llama, code, python, speculative-decoding, adaserve]
---

# adaserve default {role}

A small Llama-architecture causal LM of Python source; {purpose}.
It exists so that adaserve runs and tests with no download; it is a toy model for
serving experiments, not a useful code assistant.

## Model

| | target | draft |
|---|---|---|
| parameters | {r["target"]["parameters"]:,} | {r["draft"]["parameters"]:,} |
| layers | {r["target"]["layers"]} | {r["draft"]["layers"]} |
| hidden / MLP | {r["target"]["hidden_size"]} / {r["target"]["intermediate_size"]} | {r["draft"]["hidden_size"]} / {r["draft"]["intermediate_size"]} |
| heads / KV heads | {r["target"]["heads"]} / {r["target"]["kv_heads"]} | {r["draft"]["heads"]} / {r["draft"]["kv_heads"]} |
| held-out loss (nats/token) | {r["target"]["heldout_loss"]} | {r["draft"]["heldout_loss"]} |
| 1-token decode, 128 cached (ms) | {r["target"]["decode_1_ms"]} | {r["draft"]["decode_1_ms"]} |
| 16-token verify, 128 cached (ms) | {r["target"]["verify_16_ms"]} | {r["draft"]["verify_16_ms"]} |

Weights: `{m["weights_dtype"]}` safetensors ({m["weights_bytes"] / 1e6:.1f} MB); compute in fp32.
Vocabulary {c["vocab_size"]} (byte-level BPE, `<|endoftext|>` = EOS and document separator).
Trained on windows of up to 512 tokens; `max_position_embeddings` is 2048 but quality
beyond 512 positions is untested. Forward costs were measured with adaserve's paged
forward on the training machine ({tr["threads"]} CPU threads, {tr["machine"]}).

## Data

{c["source"]}: {c["train_files"]} training files ({c["train_tokens"]:,} tokens) and
{c["heldout_files"]} held-out files ({c["heldout_tokens"]:,} tokens). Directories
{", ".join(c["excluded_dirs"])} are excluded; a file is held out (never trained on) when
{c["heldout_rule"]}.

## Training

    {tr["command"]}

Seed {tr["seed"]}, {tr["minutes"]} minutes budget, on CPU with fp32 master weights{" and bf16 autocast" if tr.get("bf16_autocast") else ""}, AdamW (betas 0.9/0.95,
weight decay 0.1), warmup + cosine learning rate over the time budget, random windows of
the token stream. {tr["training_seconds"] / 60:.1f} minutes of training in all phases; the
invocation that wrote this card took {tr["wall_seconds"]:.0f} s (a rerun of the command
resumes finished phases and only re-measures).

| phase | objective | seconds | steps | tokens | batch x seq | peak lr | final loss (EMA) |
|---|---|---|---|---|---|---|---|
{phases}

(`kl` = KL(target || draft) over the vocabulary, from the target's logits.)

## Draft/target agreement (held-out)

{r["num_prompts"]} held-out prompts of {r["prompt_tokens"]} tokens; the target continues each
greedily for {r["new_tokens"]} tokens and the draft is scored on that continuation.

- greedy agreement: **{r["greedy_agreement"]:.3f}**
- acceptance by child rank k=1..8 (P(target token == draft's rank-k token)): {rank}
- acceptance by chain depth d=1..8 (P(first d draft tokens all accepted)): {depth}
- target/draft 1-token cost ratio: {r["decode_cost_ratio"]}x; target 16-token verify / 1-token: {r["target_verify16_over_decode1"]}x

## Sample (target, greedy)

Prompt (held-out file):

{fence}python
{sample[0]}
{fence}

Continuation:

{fence}python
{sample[1]}
{fence}
"""
    (d / "README.md").write_text(text)
