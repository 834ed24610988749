"""Grammar masks on logits rows: the tensor side of ``adaserve.structured``.

A mask row is ``ceil(V / 32)`` int32 words, bit t of word t // 32 set when token t is
allowed (llguidance's and xgrammar's bitmask layout). Disallowed tokens get -inf, so
every distribution built from the row (greedy argmax, the seeded race, temperature /
top-k / top-p, the draft's q, residuals) puts no mass on them.
"""

from __future__ import annotations

import numpy as np
import torch

_BITS = torch.arange(32, dtype=torch.int32)


def allowed(bitmask: np.ndarray, vocab: int, device: torch.device | str) -> torch.Tensor:
    """bitmask [M, W] int32 -> [M, vocab] bool (True: allowed)."""
    b = torch.from_numpy(np.ascontiguousarray(bitmask))  # [M, W]
    bits = (b[:, :, None] >> _BITS) & 1  # [M, W, 32]
    return bits.reshape(b.shape[0], -1)[:, :vocab].bool().to(device)


def apply(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """In place: logits [N, V] rows ``rows`` (len M) keep only the tokens allowed by
    bitmask [M, W]. A row left with nothing (another mask, such as min_tokens, took the
    grammar's last tokens) gets logit 0 on every grammar-allowed token instead: the
    grammar wins, since its output must stay valid."""
    if not rows:
        return
    V = logits.shape[-1]
    ok = allowed(bitmask, V, logits.device)  # [M, V]
    idx = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, idx).masked_fill(~ok, float("-inf"))
    empty = torch.isneginf(sub).all(-1)
    if bool(empty.any()):
        sub[empty] = torch.where(ok[empty], 0.0, float("-inf")).to(sub.dtype)
    logits.index_copy_(0, idx, sub)
