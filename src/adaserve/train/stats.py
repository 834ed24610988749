"""Draft/target statistics measured on held-out prompts.

For each prompt the target generates ``new_tokens`` tokens greedily (paged KV cache).
The draft then reads prompt + target continuation in one teacher-forced pass, so at
each generated position it sees exactly the prefix a speculative step would give it:

* ``greedy_agreement``: P(draft argmax == target's greedy token), over all positions.
* ``acceptance_by_rank[k-1]``: P(target's greedy token == draft's rank-k token), k=1..8
  (rank 1 is the agreement; a tree node's k-th child is accepted with this probability).
* ``acceptance_by_depth[d-1]``: P(the first d draft greedy tokens are all accepted in a
  chain), d=1..8, averaged over every start position with d positions left.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from adaserve.models.attention import AttnMetadata, SeqSpec
from adaserve.models.llama import LlamaModel


def heldout_prompts(tok, texts: list[str], num: int, prompt_len: int) -> torch.Tensor:
    """[num, prompt_len] token ids from ``texts`` (held-out prompt texts), in order.

    Texts shorter than ``prompt_len`` tokens are skipped; raises when too few remain.
    """
    out: list[list[int]] = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        if len(ids) >= prompt_len:
            out.append(ids[:prompt_len])
        if len(out) == num:
            break
    if len(out) < num:
        raise ValueError(f"only {len(out)} held-out prompts of {prompt_len} tokens, wanted {num}")
    return torch.tensor(out, dtype=torch.long)


def _kv(model: LlamaModel, slots: int):
    c = model.cfg
    p = next(model.parameters())
    shape = (slots, c.num_kv_heads, c.head_dim)
    return [
        (torch.zeros(shape, dtype=p.dtype), torch.zeros(shape, dtype=p.dtype))
        for _ in range(c.num_layers)
    ]


@torch.inference_mode()
def greedy_generate(model: LlamaModel, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of every prompt [R, P] -> [R, new_tokens] (paged KV cache)."""
    R, P = prompts.shape
    span = P + new_tokens
    kv = _kv(model, R * span)
    dev = torch.device("cpu")
    out = torch.empty(R, new_tokens, dtype=torch.long)
    seqs = [
        SeqSpec(
            prefix_slots=[], new_slots=list(range(r * span, r * span + P)), positions=list(range(P))
        )
        for r in range(R)
    ]
    hidden = model(prompts.reshape(-1), AttnMetadata.build(seqs, dev), kv)
    last = hidden.view(R, P, -1)[:, -1]
    nxt = model.logits(last).argmax(-1)
    for t in range(new_tokens):
        out[:, t] = nxt
        if t == new_tokens - 1:
            break
        pos = P + t
        seqs = [
            SeqSpec(
                prefix_slots=list(range(r * span, r * span + pos)),
                new_slots=[r * span + pos],
                positions=[pos],
            )
            for r in range(R)
        ]
        hidden = model(nxt, AttnMetadata.build(seqs, dev), kv)
        nxt = model.logits(hidden).argmax(-1)
    return out


@torch.inference_mode()
def pair_stats(
    target: LlamaModel,
    draft: LlamaModel,
    prompts: torch.Tensor,
    new_tokens: int = 64,
    max_rank: int = 8,
    max_depth: int = 8,
) -> dict:
    """Agreement/acceptance of ``draft`` against ``target``'s greedy continuations."""
    R, P = prompts.shape
    cont = greedy_generate(target, prompts, new_tokens)  # [R, N]
    seq = torch.cat([prompts, cont], dim=1)
    # ids the draft lacks (a smaller vocabulary, as Qwen2.5-0.5B's) enter it as its last id
    din = seq[:, :-1].clamp(max=draft.cfg.vocab_size - 1)
    logits = draft.forward_dense(din).float()[:, P - 1 :]  # predicts cont
    ranked = logits.topk(max_rank, dim=-1).indices  # [R, N, K]
    hit = ranked == cont.unsqueeze(-1)  # [R, N, K]
    by_rank = [hit[..., k].float().mean().item() for k in range(max_rank)]
    match = hit[..., 0]
    by_depth = []
    for d in range(1, min(max_depth, new_tokens) + 1):
        chains = match.unfold(1, d, 1).all(-1)  # [R, N-d+1]
        by_depth.append(chains.float().mean().item())
    # expected tokens accepted by a greedy chain of length max_depth (+1 bonus token)
    expected = 1.0 + sum(by_depth)
    # top-1 agreement per 32-token block of the continuation (it drifts along it)
    by_pos = [match[:, i : i + 32].float().mean().item() for i in range(0, new_tokens, 32)]
    # agreement right after a miss: how persistent the draft's bad stretches are
    missed = ~match[:, :-1]
    after_miss = (match[:, 1:] & missed).sum().item() / max(missed.sum().item(), 1)
    return {
        "num_prompts": R,
        "prompt_tokens": P,
        "new_tokens": new_tokens,
        "greedy_agreement": by_rank[0],
        "acceptance_by_rank": by_rank,
        "acceptance_by_depth": by_depth,
        "expected_tokens_per_chain_step": expected,
        "agreement_by_position": by_pos,
        "agreement_after_miss": after_miss,
    }


@torch.inference_mode()
def forward_costs(model: LlamaModel, context: int = 128, repeats: int = 40) -> dict:
    """Median ms of one paged forward + logits with ``context`` cached tokens.

    ``decode_1_ms``: one new token (batch 1); ``verify_16_ms``: 16 new tokens of one
    request (causal, as when verifying a 16-token speculation).
    """
    res = {}
    for q, key in ((1, "decode_1_ms"), (16, "verify_16_ms")):
        kv = _kv(model, context + q)
        meta = AttnMetadata.build(
            [
                SeqSpec(
                    list(range(context)),
                    list(range(context, context + q)),
                    list(range(context, context + q)),
                )
            ],
            torch.device("cpu"),
        )
        ids = torch.randint(
            0, model.cfg.vocab_size, (q,), generator=torch.Generator().manual_seed(0)
        )
        times = []
        for i in range(repeats + 5):
            t0 = time.perf_counter()
            model.logits(model(ids, meta, kv))
            if i >= 5:
                times.append(time.perf_counter() - t0)
        res[key] = round(statistics.median(times) * 1e3, 3)
    return res


def engine_calibration(
    target_dir, draft_dir, prompts: list[list[int]], new_tokens: int = 48
) -> dict:
    """Acceptance measured by the engine itself on held-out prompts.

    Runs a static width-3 depth-4 tree over ``prompts`` and returns the calibrator's
    counts: acceptance of a tried child by (depth, draft-probability bucket) and by
    sibling rank. The engine seeds its online calibration from this table.
    """
    from adaserve.engine.api import LLM
    from adaserve.sampling import SamplingParams

    llm = LLM(
        model=str(target_dir),
        draft=str(draft_dir),
        policy="spec-tree:4x3:100",
        auto_profile=False,
        kv_cache_bytes=256 << 20,
    )
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    cal = llm.engine.calibrator
    rank_tried = np.maximum(cal.rank_tried, 1.0)
    return {
        "policy": "spec-tree:4x3:100",
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "acceptance": cal.table().round(4).tolist(),
        "tried": cal.tried.astype(int).tolist(),
        "accepted": cal.accepted.astype(int).tolist(),
        "acceptance_by_rank": (cal.rank_accepted / rank_tried).round(4).tolist(),
    }
