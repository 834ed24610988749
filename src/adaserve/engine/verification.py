"""Acceptance of the verification pass for every request of a step: the batched
verifier (``spec_decode.verify``) decides which tree nodes the target keeps and the
bonus token after them; this module turns its result into what the commit applies
(new tokens, their log-probabilities, the KV compaction). The commit does no row
arithmetic of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adaserve.engine.model_runner import VerifyPass, logprob_entries
from adaserve.spec_decode.batch import compact_moves
from adaserve.spec_decode.verify import verify


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
    """Every request's ``Accepted`` by rid, and the target KV slot moves it implies
    (root + accepted path -> contiguous positions C-1, C, C+1, ...)."""

    accepted: dict[int, Accepted] = field(default_factory=dict)
    moves_src: list[int] = field(default_factory=list)
    moves_dst: list[int] = field(default_factory=list)


def accept(vp: VerifyPass | None) -> StepResult:
    """Verify the pass ``vp`` (one device-to-host copy) -> the step's accepted tokens."""
    out = StepResult()
    if vp is None:
        return out
    res = verify(vp.batch, vp.logits)
    for i, r in enumerate(vp.requests):
        path, new = res.accepted[i], res.new_tokens[i]
        lp = None
        if r.params.logprobs is not None:  # token j was drawn at logits row token_rows[i][j]
            rows = torch.tensor(res.token_rows[i], device=vp.logits.device)
            lsm = torch.log_softmax(vp.logits[rows], dim=-1)
            lp = logprob_entries(lsm, new, r.params.logprobs)
        if path:
            src, dst = compact_moves(path, len(r.tokens))
            assert r.table is not None  # a running request has a table
            out.moves_src += [r.table.slot(p) for p in src]
            out.moves_dst += [r.table.slot(p) for p in dst]
        out.accepted[r.rid] = Accepted(list(path), new, lp)
    return out
