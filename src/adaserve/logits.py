"""Target-distribution processing of logits (temperature, top-k, top-p) and
per-request random generators."""

from __future__ import annotations

import torch

from adaserve.sampling import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed target distribution: logits [N, V] -> probs [N, V] (float32).

    Temperature first, then top-k, then top-p (the smallest set whose mass reaches
    top_p, always keeping the most likely token), then min-p (tokens less likely than
    min_p times the most likely one); the rest get probability 0.
    """
    x = logits.float() / max(params.temperature, 1e-5)
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = before >= params.top_p
        drop_sorted[..., 0] = False  # top_p below float32 resolution must not drop all
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if params.min_p > 0:
        p = x.softmax(-1)
        x = x.masked_fill(p < params.min_p * p.amax(-1, keepdim=True), float("-inf"))
    return x.softmax(-1)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A per-request generator: seeded when ``seed`` is given, random otherwise."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
