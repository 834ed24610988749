"""Acceptance of the verification pass: which tree nodes the target keeps, the bonus
token after them, and the KV compaction that follows, for every request of a step.

``accept`` consumes the logits rows in the order ``ModelRunner.verify_forward``
produced them (completing prefills, then each decoding request's 1+N nodes) and is
the only code that walks them; the commit reads its ``StepResult``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adaserve.core.scheduler import Batch
from adaserve.core.tree import CandidateTree
from adaserve.engine.model_runner import logprob_entries
from adaserve.logits import target_probs
from adaserve.request import Request
from adaserve.spec_decode.draft import DraftOutput
from adaserve.spec_decode.verify import children_lists, verify_greedy, verify_stochastic


@dataclass
class Accepted:
    """One request's outcome: the accepted candidate nodes (local indices, root
    excluded; empty for a prefill), the new tokens (accepted + bonus) and, with
    ``params.logprobs``, one log-probability entry per new token."""

    path: list[int]
    tokens: list[int]
    logprobs: list | None = None


@dataclass
class StepResult:
    """Every request's ``Accepted``, and the target KV slot moves it implies
    (root + accepted path -> contiguous positions C-1, C, C+1, ...)."""

    prefill: dict[int, Accepted] = field(default_factory=dict)
    decode: dict[int, Accepted] = field(default_factory=dict)
    moves_src: list[int] = field(default_factory=list)
    moves_dst: list[int] = field(default_factory=list)


def accept(
    batch: Batch,
    trees: dict[int, CandidateTree],
    drafts: dict[int, DraftOutput],
    logits: torch.Tensor | None,
    draft_sample: bool,
) -> StepResult:
    """logits: [rows, V] from ``verify_forward`` -> the step's accepted tokens."""
    out = StepResult()
    if logits is None:
        return out
    argmax = logits.argmax(-1).tolist()
    row = 0
    for r, n in batch.prefill:
        if r.num_cached + n != len(r.tokens):
            continue  # a chunk that does not complete the prompt produces nothing
        tok = argmax[row] if r.params.greedy else _sample(logits[row : row + 1], r)
        lp = _logprobs(r, logits, [row], [tok])
        out.prefill[r.rid] = Accepted([], [tok], lp)
        row += 1
    for r in batch.decode:
        t = trees[r.rid]
        k = len(t.tokens)
        ch = children_lists(t.parents)
        if r.params.greedy:
            path, bonus = verify_greedy(t.tokens, ch, argmax[row : row + k])
        else:
            probs = target_probs(logits[row : row + k], r.params)
            q = _draft_q_rows(drafts.get(r.rid), t, probs) if draft_sample else None
            path, bonus = verify_stochastic(t.tokens, ch, probs, r.gen, q)
        C = len(r.tokens)
        for i, node in enumerate(path):
            if node != i + 1:
                out.moves_src.append(r.table.slot(C - 1 + node))
                out.moves_dst.append(r.table.slot(C + i))
        new = [int(t.tokens[p]) for p in path] + [bonus]
        # token j is drawn at node [root, *path][j]
        lp = _logprobs(r, logits, [row + n for n in [0, *path]], new)
        out.decode[r.rid] = Accepted(list(path), new, lp)
        row += k
    return out


def _logprobs(r: Request, logits: torch.Tensor, rows: list[int], new: list[int]) -> list | None:
    """The target's log-probabilities of ``new`` (token j drawn at logits row
    ``rows[j]``) and the top ``params.logprobs`` alternatives; None when not asked."""
    if r.params.logprobs is None:
        return None
    lsm = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)], dim=-1)
    return logprob_entries(lsm, new, r.params.logprobs)


def _sample(logits_row: torch.Tensor, r: Request) -> int:
    """logits_row: [1, V] -> a token drawn from the target distribution."""
    p = target_probs(logits_row, r.params)[0]
    return int(torch.multinomial(p, 1, generator=r.gen).item())


def _draft_q_rows(
    d: DraftOutput | None, sub: CandidateTree, probs: torch.Tensor
) -> torch.Tensor | None:
    """probs: [k, V] -> the draft's q rows [k, V] of the subtree's nodes (zeros where
    the draft sampled no row), or None."""
    if d is None or not d.q_rows or len(sub.tokens) == 1:
        return None
    q = torch.zeros_like(probs)
    for local, o in enumerate(sub.origin):
        row = d.q_rows.get(int(o))
        if row is not None:
            q[local] = row
    return q
