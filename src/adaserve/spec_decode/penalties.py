"""Penalties of tree rows: each row of a logits tensor (a tree node of the draft or of
the verifier) is penalised with the counts of its own context, the request's prompt
and committed output plus the tokens on the node's path below the root.

The processed distribution at a node depends on the tokens before it, so speculation
stays lossless only if every node gets the penalties of *its* path, exactly as plain
decoding would compute them once that path were committed (``logits.apply_penalties``
does the arithmetic for both).

Host work (``PenaltyRows.build``) lists (context, token) pairs; ``apply`` turns them
into dense counts on the device with scatters: no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from adaserve.sampling import SamplingParams
from adaserve.spec_decode.logits import apply_penalties


@dataclass(frozen=True)
class PenaltyRows:
    """The penalised rows of one logits tensor and their contexts (device tensors).

    P contexts (requests), M penalised rows:
      rows:        [M] int64, the logits rows to penalise
      ctx:         [M] int64, the context (0..P-1) of each row
      prompt_pair: [2, Kp] int64, (context, token) of every prompt token
      output_pair: [2, Ko] int64, (context, token) of every committed output token
                   (a token that occurs k times appears k times)
      path_pair:   [2, Kq] int64, (row m in 0..M-1, token) of every token on a row's
                   path below the root (the candidates the row's context adds)
      repetition, frequency, presence: [M] float32
      num_contexts: P
    """

    rows: torch.Tensor
    ctx: torch.Tensor
    prompt_pair: torch.Tensor
    output_pair: torch.Tensor
    path_pair: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    num_contexts: int

    @classmethod
    def build(
        cls,
        contexts: Sequence[tuple[Sequence[int], Sequence[int], SamplingParams]],
        rows: Sequence[Sequence[tuple[int, Sequence[int]]]],
        device: torch.device | str,
    ) -> PenaltyRows:
        """contexts: P (prompt ids, committed output ids, params) of penalised requests
        rows:     per context, its rows as (logits row, path tokens below the root)"""
        if len(contexts) != len(rows):
            raise ValueError("contexts and rows differ in length")
        row_at: list[Any] = []
        ctx: list[Any] = []
        path_m: list[Any] = []
        path_t: list[Any] = []
        rep, freq, pres = [], [], []
        for c, ((_, _, sp), rs) in enumerate(zip(contexts, rows)):
            for row, path in rs:
                path_m.extend([len(row_at)] * len(path))
                path_t.extend(path)
                row_at.append(row)
                ctx.append(c)
                rep.append(sp.repetition_penalty)
                freq.append(sp.frequency_penalty)
                pres.append(sp.presence_penalty)

        def pairs(which: int) -> np.ndarray:
            ids = [np.asarray(c[which], dtype=np.int64) for c in contexts]
            owner = [np.full(len(a), i, dtype=np.int64) for i, a in enumerate(ids)]
            if not ids:
                return np.zeros((2, 0), dtype=np.int64)
            return np.stack([np.concatenate(owner), np.concatenate(ids)])

        def t64(a) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a, dtype=np.int64)).to(device)

        def f32(a) -> torch.Tensor:
            return torch.tensor(a, dtype=torch.float32).to(device)

        return cls(
            rows=t64(row_at),
            ctx=t64(ctx),
            prompt_pair=t64(pairs(0)),
            output_pair=t64(pairs(1)),
            path_pair=t64(np.array([path_m, path_t], dtype=np.int64).reshape(2, -1)),
            repetition=f32(rep),
            frequency=f32(freq),
            presence=f32(pres),
            num_contexts=len(contexts),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V] -> [N, V] float32 with the penalised rows replaced (a new
        tensor; the other rows unchanged)."""
        if not self.rows.numel():
            return logits
        P, V, dev = self.num_contexts, logits.shape[-1], logits.device
        out = torch.zeros(P, V, dtype=torch.float32, device=dev)
        ones = torch.ones(self.output_pair.shape[1], dtype=torch.float32, device=dev)
        out.index_put_((self.output_pair[0], self.output_pair[1]), ones, accumulate=True)
        prompt = torch.zeros(P, V, dtype=torch.bool, device=dev)
        prompt[self.prompt_pair[0], self.prompt_pair[1]] = True
        counts = out.index_select(0, self.ctx)  # [M, V]
        ones = torch.ones(self.path_pair.shape[1], dtype=torch.float32, device=dev)
        counts.index_put_((self.path_pair[0], self.path_pair[1]), ones, accumulate=True)
        x = apply_penalties(
            logits.index_select(0, self.rows),
            prompt.index_select(0, self.ctx),
            counts,
            self.repetition,
            self.frequency,
            self.presence,
        )
        return logits.float().index_copy(0, self.rows, x)


def tree_paths(
    parents: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray
) -> list[list[int]]:
    """Per node of a tree (root 0, parents before children): the tokens on its path
    below the root, the root excluded and the node included (the root: none)."""
    paths: list[list[int]] = [[]]
    for i in range(1, len(tokens)):
        paths.append(paths[int(parents[i])] + [int(tokens[i])])
    return paths
