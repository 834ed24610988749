"""Lossless verification of a token tree against the target model.

Terminology (as in vLLM's rejection sampler):
- *accepted* tokens: draft candidates on the path the target agrees with;
- *bonus* token: the one extra token every verification yields, drawn from the
  target (or the residual) distribution at the last accepted node.

Greedy: follow the child equal to the target's argmax; the argmax at the first
mismatch is the bonus. Stochastic, deterministic (top-k/beam) drafts: at a node, try
its children in order; accept child x with probability ``p(x)`` under the current
residual p; on rejection set ``p(x) = 0`` and renormalise; when every child is
rejected, sample the bonus from p. Stochastic, sampled drafts (children drawn i.i.d.
from the draft distribution q): accept with ``min(1, p(x)/q(x))``, on rejection
``p := normalise(max(0, p - q))`` (SpecInfer's multi-step speculative sampling).
Both give tokens distributed exactly as the processed target distribution.
"""

from __future__ import annotations

import torch


def children_lists(parents) -> list[list[int]]:
    """Children of each node, in node order (the fixed order verification tries them)."""
    ch: list[list[int]] = [[] for _ in range(len(parents))]
    for i in range(1, len(parents)):
        ch[int(parents[i])].append(i)
    return ch


def verify_greedy(tokens, children: list[list[int]], argmax: list[int]) -> tuple[list[int], int]:
    """Walk the tree along the target's argmax.

    tokens:   node tokens (node 0 = root)
    argmax:   target argmax token at each node
    returns   (accepted node indices excluding the root, bonus token)
    """
    node, path = 0, []
    while True:
        want = argmax[node]
        nxt = next((c for c in children[node] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def verify_stochastic(
    tokens,
    children: list[list[int]],
    probs: torch.Tensor,
    gen: torch.Generator,
    draft_q: torch.Tensor | None = None,
) -> tuple[list[int], int]:
    """Walk the tree with the lossless residual method.

    probs:    [n, V] processed target distribution at each node
    draft_q:  [n, V] draft distribution the children of each node were sampled from
              (sampled drafts), or None for deterministic drafts
    returns   (accepted node indices excluding the root, bonus token)
    """
    node, path = 0, []
    while True:
        p = probs[node].clone()
        accepted = None
        for c in children[node]:
            x = int(tokens[c])
            u = torch.rand((), generator=gen, device=p.device)
            if draft_q is None:
                a = p[x]
                if u < a:
                    accepted = c
                    break
                p[x] = 0.0
                p = p / p.sum().clamp_min(1e-30)
            else:
                q = draft_q[node]
                a = torch.clamp(p[x] / q[x].clamp_min(1e-30), max=1.0)
                if u < a:
                    accepted = c
                    break
                r = (p - q).clamp_min(0.0)
                s = r.sum()
                # p == q exactly leaves nothing; then p is unchanged (acceptance was 1)
                p = r / s if s > 0 else p
        if accepted is None:
            bonus = int(torch.multinomial(p, 1, generator=gen).item())
            return path, bonus
        path.append(accepted)
        node = accepted
