"""Lossless verification of token trees against the target model, one batch a step.

Terminology (as in vLLM's rejection sampler, for trees):
- *accepted* tokens: draft candidates on the root-to-node path the target agrees
  with (the accepted path; node indices local to the request's tree, root excluded);
- *residual* distribution: at a node whose children are being tried, the target
  distribution with the mass of the rejected children taken out (renormalised);
- *recovered* token: drawn from the residual at the last accepted node after all its
  children were rejected;
- *bonus* token: drawn from the target at the last accepted node when it is a leaf
  (nothing was left to try). Recovered or bonus, it is the one extra token every
  verification yields, so ``VerifyResult.bonus`` holds either (greedy: the argmax).

Penalties (presence / frequency / repetition, ``VerifyBatch.penalties``): the
processed distribution at a node depends on the tokens before it, so every node's
logits row is penalised first with the counts of its own path (prompt, committed
output, the candidates from the root down to it): the distribution plain decoding
would use once that path is committed. Everything below (greedy argmax, seeded race,
residuals) then sees the penalised logits, hence the same guarantees.

Greedy: follow the first child (in node order) whose token is the target's argmax;
the argmax at the first node without one is the bonus. Stochastic, deterministic
(top-k/beam) drafts: at a node, try its children in order; accept child x with
probability ``p(x)`` under the current residual p; on rejection set ``p(x) = 0`` and
renormalise; when every child is rejected, draw from p. Stochastic, sampled drafts
(children drawn i.i.d. from the draft distribution q): accept with ``min(1, p(x)/q(x))``,
on rejection ``p := normalise(max(0, p - q))`` (SpecInfer's multi-step speculative
sampling). Both give tokens distributed exactly as the processed target distribution.

Seeded (stochastic with ``params.seed``): the token at output index o is
``argmax_x p(x) / E_o(x)`` with p the processed target distribution at that context and
``E_o = race_noise([noise_key(seed, o)])`` i.i.d. Exp(1) noise that depends on the seed
and o only (the exponential race / Gumbel-max trick: an exact sample of p, since E_o
is independent of the tokens before o). With the noise fixed the token is a function
of the context, so the tree is verified like a greedy one against that perturbed
argmax: accept the first child whose token is it, the bonus is it at the last
accepted node. The tokens are exactly those of non-speculative seeded sampling, hence
lossless and the same under any tree, policy, load or batch (up to the target's
numerics: logits that move with the batch shape can flip a near tie, as for greedy).

Batched (``verify``): the decision at a node depends only on that node's target row,
its children, q and uniforms that belong to that node, so every node of every tree
is decided at once (sibling rank by sibling rank, all nodes together), and the walk
from each root then follows the accepted child of each node (``max_depth`` gathers).
Nodes the walk never reaches are decided too, with uniforms nothing else uses, so
the visited nodes see fresh, independent uniforms: the same law as the one-node-at-
a-time walk, hence lossless. Randomness: an unseeded stochastic request with n nodes
draws ``torch.rand(n, float64)`` from its own generator, once a step: entry 0 (the
root's) is the uniform of its bonus/recovered draw (by inverse CDF, in float64), entry
c >= 1 the uniform that accepts or rejects node c. Its result therefore depends only on its
tree, its logits rows and its generator, not on the other requests in the batch; the
same generator state gives the same tokens. Greedy requests draw nothing; seeded ones
draw from ``race_noise`` only, one row per depth of their tree.

Host syncs: ``verify_device`` launches device work only (no ``.item()``, ``.tolist()``,
boolean-mask indexing or data-dependent shapes); ``verify`` copies its one packed
``[R, max_depth + 1]`` int64 result to the host with a single ``.tolist()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaserve.spec_decode.batch import VerifyBatch
from adaserve.spec_decode.logits import race_noise, target_probs


@dataclass
class VerifyResult:
    """Per request r of the batch, in batch order (host lists).

    accepted:     [R][A_r] accepted path: local node indices, root excluded, root-to-leaf
    bonus:        [R] the token drawn at the last accepted node (the root when A_r == 0):
                  greedy argmax, or the recovered/bonus sample
    num_accepted: [R] A_r
    new_tokens:   [R][A_r + 1] the tokens the request gains: accepted tokens, then bonus
    token_rows:   [R][A_r + 1] global node index (logits row) each new token was drawn
                  at: the root, then the accepted nodes (for logprobs)
    """

    accepted: list[list[int]]
    bonus: list[int]
    num_accepted: list[int]
    new_tokens: list[list[int]]
    token_rows: list[list[int]]


@torch.inference_mode()
def verify(batch: VerifyBatch, logits: torch.Tensor) -> VerifyResult:
    """Verify every request of ``batch``.

    logits: [N, V] float32, the target's logits at every node (row i = global node i,
            each request's root first)
    """
    D = batch.max_depth
    packed = verify_device(batch, logits).tolist()  # the step's one device-to-host copy
    cu, toks = batch.cu_nodes, batch.tokens_host
    accepted, bonus, rows, new = [], [], [], []
    for r, row in enumerate(packed):
        path = [x for x in row[:D] if x >= 0]
        at = [int(cu[r])] + [int(cu[r]) + x for x in path]
        accepted.append(path)
        bonus.append(row[D])
        rows.append(at)
        new.append([int(toks[i]) for i in at[1:]] + [row[D]])
    return VerifyResult(accepted, bonus, [len(p) for p in accepted], new, rows)


@torch.inference_mode()
def verify_device(batch: VerifyBatch, logits: torch.Tensor) -> torch.Tensor:
    """The verification as device work only (no host sync).

    logits:  [N, V] float32, as for ``verify`` (raw: the penalties are applied here)
    returns  [R, max_depth + 1] int64: columns 0..max_depth-1 the accepted path (local
             node indices, -1 past its end), the last column the bonus token
    """
    N, R, dev = batch.num_nodes, batch.num_requests, logits.device
    if logits.dim() != 2 or logits.shape[0] != N:
        raise ValueError(f"logits {tuple(logits.shape)} for a batch of {N} nodes")
    if batch.penalties is not None:  # [N, V]: each node's row with its own path's counts
        logits = batch.penalties.apply(logits)
    acc = torch.full((N,), -1, dtype=torch.long, device=dev)  # [N] accepted child, -1: none
    probs = None
    if batch.prob_groups:
        probs = torch.empty_like(logits, dtype=torch.float32)  # [N, V]; greedy rows unused
        for params, idx in batch.prob_groups:
            probs.index_copy_(0, idx, target_probs(logits.index_select(0, idx), params))
    # [N] the token a child of a greedy or seeded node must be: the argmax of the raw
    # logits, or of p / E for a seeded node (its position's noise row)
    argmax = logits.argmax(-1) if any(batch.greedy) or any(batch.seeded) else None
    if any(batch.seeded):
        assert probs is not None and argmax is not None  # seeded nodes are sampled
        s = batch.seeded_nodes
        race = race_noise(batch.noise_keys, logits.shape[-1], dev)  # [K, V]
        score = probs.index_select(0, s) / race.index_select(0, batch.noise_rows)
        argmax = argmax.index_copy(0, s, score.argmax(-1))
    if argmax is not None and batch.argmax_child.numel():
        par, ch = batch.argmax_parent, batch.argmax_child
        match = batch.tokens[ch] == argmax[par]
        # the first matching child in node order (children have increasing indices)
        first = acc.new_full((N,), N).scatter_reduce_(
            0, par, torch.where(match, ch, N), "amin", include_self=True
        )
        acc = torch.where(first < N, first, acc)
    residual = batch.stochastic.numel() > 0  # unseeded stochastic requests (host metadata)
    u = None
    if residual:
        u = _uniforms(batch, dev)
        assert probs is not None  # stochastic requests are sampled
        for step in batch.sibling_steps:
            _try_siblings(step, batch, probs, u, acc)
    cur = batch.roots.clone()  # [R] last accepted node
    path = torch.full((R, batch.max_depth), -1, dtype=torch.long, device=dev)
    for d in range(batch.max_depth):
        nxt = acc[cur]
        path[:, d] = nxt
        cur = torch.where(nxt >= 0, nxt, cur)
    bonus = argmax[cur] if argmax is not None else torch.zeros(R, dtype=torch.long, device=dev)
    if residual:
        assert probs is not None and u is not None  # as above
        s = batch.stochastic
        last = cur.index_select(0, s)
        draw = _inverse_cdf(probs.index_select(0, last), u.index_select(0, batch.roots[s]))
        bonus = bonus.index_copy(0, s, draw)
    local = torch.where(path >= 0, path - batch.roots[:, None], path)
    return torch.cat([local, bonus[:, None]], 1)


def _uniforms(batch: VerifyBatch, device) -> torch.Tensor:
    """[N] float64: each unseeded stochastic request's nodes get ``torch.rand(n)`` from
    its own generator (entry 0: its bonus draw; entry c: node c's acceptance); greedy
    and seeded: 0."""
    u = torch.zeros(batch.num_nodes, dtype=torch.float64, device=device)
    cu = batch.cu_nodes
    for r, g in enumerate(batch.generators):
        if not batch.greedy[r] and not batch.seeded[r]:
            a, b = int(cu[r]), int(cu[r + 1])
            u[a:b] = torch.rand(b - a, generator=g, dtype=torch.float64, device=device)
    return u


def _try_siblings(
    step, batch: VerifyBatch, probs: torch.Tensor, u: torch.Tensor, acc: torch.Tensor
) -> None:
    """Try the j-th child of every parent in ``step`` that has accepted none yet,
    updating ``acc`` [N] and the parents' residual rows of ``probs`` [N, V] in place."""
    par, ch = step.parent, step.child  # [M], [M]
    alive = acc.index_select(0, par) < 0  # [M]
    p = probs.index_select(0, par)  # [M, V] residual
    x = batch.tokens.index_select(0, ch)[:, None]  # [M, 1]
    px = p.gather(1, x)[:, 0]
    if step.with_q:
        assert batch.draft_q is not None  # a step with q has its rows
        q = batch.draft_q.index_select(0, par)  # [M, V]
        a = (px / q.gather(1, x)[:, 0].clamp_min(1e-30)).clamp(max=1.0)
    else:
        a = px
    ok = alive & (u.index_select(0, ch) < a)
    acc.index_copy_(0, par, torch.where(ok, ch, acc.index_select(0, par)))
    if step.with_q:
        res = (p - q).clamp_min(0.0)
        s = res.sum(-1, keepdim=True)
        # p == q exactly leaves nothing; then p is unchanged (acceptance was 1)
        res = torch.where(s > 0, res / s.clamp_min(1e-30), p)
    else:
        res = p.scatter(1, x, 0.0)
        res = res / res.sum(-1, keepdim=True).clamp_min(1e-30)
    probs.index_copy_(0, par, torch.where((alive & ~ok)[:, None], res, p))


def _inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of p [M, V] (float32, rows need not be normalised) with the
    uniforms u [M] (float64): the first token whose float64 CDF exceeds u * total.
    A token of probability 0 is never drawn."""
    cdf = p.double().cumsum(-1)  # [M, V]
    total = cdf[:, -1:].contiguous()  # [M, 1]
    idx = torch.searchsorted(cdf, u[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total)  # the last token with mass (u * total rounded up)
    return torch.minimum(idx, last)[:, 0]
