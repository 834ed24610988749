"""Target-distribution processing of logits (penalties, temperature, top-k, top-p,
min-p), per-request random generators, and the position-keyed noise of seeded
sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adaserve.sampling import SamplingParams

PENALTY_LOGIT_CAP = 1e30


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties of logits rows, each row with its own context (a new tensor).

    logits:        [M, V] raw logits
    prompt_mask:   [M, V] bool, the token occurs in the row's prompt
    output_counts: [M, V] float32, occurrences of the token among the row's output
                   tokens (those generated before the position the row predicts)
    repetition, frequency, presence: [M] float32, each row's penalties

    Repetition (over prompt + output tokens): a seen token's logit is divided by the
    penalty when positive, multiplied by it otherwise. Then frequency and presence
    (OpenAI's definition, over output tokens): ``logit -= frequency * count +
    presence * (count > 0)``. The same arithmetic as vLLM's ``apply_penalties``;
    ``target_probs`` (temperature and truncation) comes after.
    """
    x = logits.float()
    seen_out = output_counts > 0
    rep = torch.where(prompt_mask | seen_out, repetition[:, None], 1.0)
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - frequency[:, None] * output_counts
    x = x - presence[:, None] * seen_out.float()
    # a tiny or huge penalty (5e-324 is 0 in float32) makes a logit infinite; softmax
    # of +inf (or of a row all -inf) is NaN, which no sampler can draw from. Capped
    # here, the row stays a distribution: the token the penalty favours most wins.
    # ``PENALTY_LOGIT_CAP`` / the smallest temperature (1e-5) still fits float32.
    return x.clamp_(-PENALTY_LOGIT_CAP, PENALTY_LOGIT_CAP)


def add_logit_bias(logits: torch.Tensor, rows, bias: tuple[tuple[int, float], ...]) -> None:
    """In place: logits [N, V] rows ``rows`` get ``bias`` ((token id, bias) pairs)
    added to those tokens' logits (OpenAI's logit_bias)."""
    if not rows or not bias:
        return
    dev = logits.device
    ids = torch.tensor([k for k, _ in bias], device=dev)
    vals = torch.tensor([v for _, v in bias], device=dev, dtype=logits.dtype)
    r = torch.as_tensor(list(rows), device=dev)[:, None]
    logits[r, ids[None, :]] += vals[None, :]


def bad_word_bans(context: Sequence[int], words: Sequence[Sequence[int]]) -> list[int]:
    """The token ids banned after ``context`` by the bad words ``words`` (token id
    sequences): a word's last token wherever the context ends with the rest of it (a
    one-token word: always)."""
    out = []
    for w in words:
        k = len(w) - 1
        if k == 0 or (len(context) >= k and list(context[len(context) - k :]) == list(w[:-1])):
            out.append(int(w[-1]))
    return out


def ban_tokens(logits: torch.Tensor, bans: Sequence[tuple[int, Sequence[int]]]) -> None:
    """In place: ``(row, token ids)`` pairs of logits [N, V] set to -inf."""
    rows = [r for r, ids in bans for _ in ids]
    if rows:
        cols = [t for _, ids in bans for t in ids]
        dev = logits.device
        logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")


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


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash of int64 x in [0, 2**32) (in place): the
    "prospector32" of Wellons' hash-prospector (xorshift-multiply, 2 rounds). Its
    multipliers are below 2**31, so no int64 product overflows."""
    x ^= x >> 15
    x.mul_(0x2C1B3C6D).bitwise_and_(_M32)
    x ^= x >> 12
    x.mul_(0x297A2D39).bitwise_and_(_M32)
    x ^= x >> 15
    return x


def race_noise(keys: Sequence[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """[K, vocab] float32 exponential variates E = -log(U), row k i.i.d. over the
    vocabulary and a function of ``keys[k]`` only: not of the other rows, the batch,
    any generator's state or the device (the same numbers on CPU and GPU).

    Seeded sampling draws the token of a distribution p as ``argmax_x p(x) / E(x)``
    (the exponential race, i.e. the Gumbel-max trick: ``log p - log E`` is ``log p``
    plus standard Gumbel noise), an exact sample of p for E i.i.d. Exp(1).

    U is a counter-based hash of (key, token id): two 32-bit words, each two keyed
    rounds of ``_mix32`` under 64 bits of key material, make its 53 bits (float64,
    in (0, 1)). All integer work is int64 with no overflow; rows are hashed in chunks
    that stay in cache on a CPU and are few launches on a GPU."""
    device = torch.device(device)
    out = torch.empty(len(keys), vocab, dtype=torch.float32, device=device)
    words = []
    for k in keys:
        k2 = _splitmix64(k & _M64)
        words.append([k & _M32, (k & _M64) >> 32, k2 & _M32, k2 >> 32])
    if not keys:
        return out
    kw = torch.tensor(words, dtype=torch.int64, device=device)  # [K, 4]
    x = torch.arange(vocab, dtype=torch.int64, device=device)[None]  # [1, V]
    rows = max(1, (1 << (16 if device.type == "cpu" else 24)) // max(vocab, 1))
    for a in range(0, len(keys), rows):
        kr = kw[a : a + rows]
        hi = _mix32(_mix32(x ^ kr[:, 0:1]).bitwise_xor_(kr[:, 1:2]))
        lo = _mix32(_mix32(x ^ kr[:, 2:3]).bitwise_xor_(kr[:, 3:4]))
        v = hi.bitwise_left_shift_(21).bitwise_or_(lo.bitwise_right_shift_(11))  # [0, 2**53)
        u = v.double().add_(0.5).mul_(2.0**-53)
        out[a : a + rows] = u.log_().neg_()
    return out
