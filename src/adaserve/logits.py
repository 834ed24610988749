"""Target-distribution processing of logits (temperature, top-k, top-p), per-request
random generators, and the position-keyed noise of seeded sampling."""

from __future__ import annotations

from collections.abc import Sequence

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


# ---------------------------------------------------------------- seeded sampling
_M32 = (1 << 32) - 1
_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def noise_key(seed: int, index: int) -> int:
    """The 64-bit key of the sampling noise of output token ``index`` (0: the first
    generated token) of a request seeded with ``seed``: a function of the two only
    (seeds are taken modulo 2**64)."""
    return _splitmix64(_splitmix64(seed & _M64) ^ (index & _M64))


def race_noise(keys: Sequence[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """[K, vocab] float32 exponential variates E = -log(U), row k i.i.d. and a function
    of ``keys[k]`` only (not of the other rows, the batch or the device's RNG state).

    Seeded sampling draws the token of a distribution p as ``argmax_x p(x) / E(x)``
    (the exponential race, i.e. the Gumbel-max trick: ``log p - log E`` is ``log p``
    plus standard Gumbel noise), an exact sample of p for E i.i.d. Exp(1). U is
    float64: uniforms of a row come from a generator seeded with the key (CUDA's
    Philox takes all 64 bits; the CPU generator keeps 32, so there U is the sum modulo
    1 of two streams, one per half of the key)."""
    device = torch.device(device)
    out = torch.empty(len(keys), vocab, dtype=torch.float32, device=device)
    g = torch.Generator(device=device)
    u = torch.empty(vocab, dtype=torch.float64, device=device)
    v = torch.empty_like(u) if device.type == "cpu" else None
    for k, key in enumerate(keys):
        if v is None:
            u.uniform_(generator=g.manual_seed(key & _M64))
        else:
            u.uniform_(generator=g.manual_seed(key & _M32))
            v.uniform_(generator=g.manual_seed((key & _M64) >> 32))
            u.add_(v).frac_()
        out[k] = u.log_().neg_()  # U = 0 gives E = inf: that token never wins
    return out
