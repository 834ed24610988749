"""Attention over a flat, ragged batch with a paged KV cache.

A forward call carries ``T`` new tokens from ``R`` requests, concatenated request by
request. Request ``r`` contributes ``q_r`` new tokens; it attends to ``c_r`` cached
tokens (its committed prefix) plus its own new tokens, through an arbitrary boolean
mask ``new_mask_r`` of shape ``[q_r, q_r]`` (causal for a prefill chunk, a tree mask
for speculation). KV for new tokens is written to ``slot_mapping`` before attention,
so the context of request r is the slot list ``prefix_slots_r + new_slots_r``.

Requests are split into groups that are padded to a common shape and run in one
``scaled_dot_product_attention`` call: long query segments (prefill chunks) run
alone so that a 256-token chunk does not pad 31 one-token decodes to 256 rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# Requests whose new-token count exceeds this run in their own attention group.
_SOLO_QUERY_LEN = 32


@dataclass
class AttnGroup:
    """Padded view of some requests of the batch.

    tok_idx:   [R, Q] long, flat token index of each (request, query row); pad rows -> 0
    ctx_slots: [R, L] long, cache slot of each context position; pad -> 0
    mask:      [R, 1, Q, L] bool, True where the query may attend
    valid:     [n_valid] long, which padded query rows (of R*Q) are real tokens
    out_idx:   [n_valid] long, flat token index of each real row (in row-major order)
    whole:     the group is the whole batch in order with no pad rows (tok_idx is
               arange(T).view(R, Q)): queries and output need no gather or scatter
    """

    tok_idx: torch.Tensor
    ctx_slots: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor
    out_idx: torch.Tensor
    whole: bool = False


@dataclass
class SeqSpec:
    """One request's part of a forward pass (host-side description).

    prefix_slots: cache slots of the already-cached context (committed prefix in position
                  order, then any draft-tree scratch slots)
    new_slots:    cache slots the new tokens are written to
    positions:    position id of each new token
    new_mask:     [q, q] bool (numpy or CPU torch) or None for causal
    prefix_mask:  [q, len(prefix_slots)] bool (numpy or CPU torch) or None when the whole
                  prefix is visible

    The sliding window (Mistral) is applied to the prefix only when ``prefix_mask`` is
    None (the prefix is then positions ``0..c-1``).
    """

    prefix_slots: list[int] | np.ndarray
    new_slots: list[int] | np.ndarray
    positions: list[int] | np.ndarray
    new_mask: np.ndarray | torch.Tensor | None = None
    prefix_mask: np.ndarray | torch.Tensor | None = None


@dataclass
class AttnMetadata:
    """Everything a paged forward needs besides the token ids.

    positions:    [T] long
    slot_mapping: [T] long, cache slot each new token's K/V is written to
    groups:       attention groups covering all T tokens exactly once
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    groups: list[AttnGroup]

    @classmethod
    def build(
        cls, seqs: list[SeqSpec], device: torch.device, sliding_window: int | None = None
    ) -> AttnMetadata:
        """Build metadata for ``seqs`` (in the order their tokens appear in the batch)."""
        lens = [len(s.new_slots) for s in seqs]
        starts = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64).tolist()
        positions = np.concatenate([np.asarray(s.positions, dtype=np.int64) for s in seqs])
        slots = np.concatenate([np.asarray(s.new_slots, dtype=np.int64) for s in seqs])
        solo = [i for i, s in enumerate(seqs) if len(s.new_slots) > _SOLO_QUERY_LEN]
        batched = [i for i, s in enumerate(seqs) if len(s.new_slots) <= _SOLO_QUERY_LEN]
        groups = [
            _make_group([seqs[i] for i in idx], [starts[i] for i in idx], device, sliding_window)
            for idx in [[i] for i in solo] + _partition(seqs, batched)
        ]
        if len(groups) == 1 and groups[0].valid.numel() == groups[0].tok_idx.numel():
            groups[0].whole = True  # one group, all of seqs in order, no padding
        return cls(
            positions=torch.from_numpy(positions).to(device),
            slot_mapping=torch.from_numpy(slots).to(device),
            groups=groups,
        )


# a group's fixed cost (gathers and one attention call per layer) in padded (query x
# context) pairs: splitting a batch is worth it when it saves more padding than this
GROUP_COST_PAIRS = 512


def _partition(seqs: list[SeqSpec], idx: list[int]) -> list[list[int]]:
    """``idx`` (sequences of short query runs: decodes, trees) in attention groups. One
    group pads every sequence to the longest query run and the longest context of the
    group, so requests of very different tree sizes and histories in one group pay for
    the largest: sorted by query length, a sequence starts a new group when the padding
    it would add to the current one costs more than a group (``GROUP_COST_PAIRS``)."""
    if len(idx) <= 1:
        return [idx] if idx else []
    q = {i: len(seqs[i].new_slots) for i in idx}
    ctx = {i: len(seqs[i].prefix_slots) + q[i] for i in idx}
    order = sorted(idx, key=lambda i: (q[i], ctx[i]))
    out, cur = [], [order[0]]
    qmax, lmax, real = q[order[0]], ctx[order[0]], q[order[0]] * ctx[order[0]]
    for i in order[1:]:
        nq, nl = max(qmax, q[i]), max(lmax, ctx[i])
        grown = (len(cur) + 1) * nq * nl - (real + q[i] * ctx[i])  # padding if it joins
        now = len(cur) * qmax * lmax - real  # padding as it is
        if grown - now > GROUP_COST_PAIRS:
            out.append(cur)
            cur, qmax, lmax, real = [i], q[i], ctx[i], q[i] * ctx[i]
        else:
            cur.append(i)
            qmax, lmax, real = nq, nl, real + q[i] * ctx[i]
    out.append(cur)
    return [sorted(g) for g in out]  # each group in batch order (``whole`` relies on it)


def _make_group(
    seqs: list[SeqSpec], starts: list[int], device: torch.device, window: int | None
) -> AttnGroup:
    # built with numpy (cheap per-request host work), moved to ``device`` once
    R = len(seqs)
    Q = max(len(s.new_slots) for s in seqs)
    L = max(len(s.prefix_slots) + len(s.new_slots) for s in seqs)
    tok_idx = np.zeros((R, Q), dtype=np.int64)
    ctx = np.zeros((R, L), dtype=np.int64)
    mask = np.zeros((R, Q, L), dtype=bool)
    valid: np.ndarray = np.zeros((R, Q), dtype=bool)
    for r, (s, start) in enumerate(zip(seqs, starts)):
        q, c = len(s.new_slots), len(s.prefix_slots)
        tok_idx[r, :q] = np.arange(start, start + q)
        ctx[r, :c] = s.prefix_slots
        ctx[r, c : c + q] = s.new_slots
        if s.prefix_mask is None:
            mask[r, :q, :c] = True
        else:
            mask[r, :q, :c] = np.asarray(s.prefix_mask, dtype=bool)
        if s.new_mask is None:
            mask[r, :q, c : c + q] = _tril(q)
        else:
            mask[r, :q, c : c + q] = np.asarray(s.new_mask, dtype=bool)
        if window is not None and s.prefix_mask is None:
            pos_q = np.asarray(s.positions)[:, None]
            pos_k = np.concatenate([np.arange(c), np.asarray(s.positions)])[None, :]
            mask[r, :q, : c + q] &= (pos_q - pos_k) < window
        mask[r, q:, 0] = True  # pad rows attend to something so softmax stays finite
        valid[r, :q] = True
    valid = valid.reshape(-1)
    out_idx = tok_idx.reshape(-1)[valid]
    return AttnGroup(
        tok_idx=torch.from_numpy(tok_idx).to(device),
        ctx_slots=torch.from_numpy(ctx).to(device),
        mask=torch.from_numpy(mask).unsqueeze(1).to(device),
        valid=torch.from_numpy(np.flatnonzero(valid)).to(device),
        out_idx=torch.from_numpy(out_idx).to(device),
    )


_TRIL: dict[int, np.ndarray] = {}


def _tril(q: int) -> np.ndarray:
    """Causal [q, q] mask (cached)."""
    m = _TRIL.get(q)
    if m is None:
        m = np.tril(np.ones((q, q), dtype=bool))
        if q <= 4096:
            _TRIL[q] = m
    return m


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: list[AttnGroup],
    scale: float,
    fold: bool | None = None,
) -> torch.Tensor:
    """Attention of the batch's queries over their paged contexts.

    q:        [T, n_heads, head_dim]
    k_cache:  [num_slots, n_kv_heads, head_dim] (new tokens already written)
    v_cache:  [num_slots, n_kv_heads, head_dim]
    fold:     fold grouped query heads into query rows for every group, not only for
              decodes (default: on CUDA, whose fast mask-taking kernel lacks GQA)
    returns   [T, n_heads, head_dim]
    """
    T, H, D = q.shape
    Hkv = k_cache.shape[1]
    if fold is None:
        fold = q.is_cuda
    out = None if groups[0].whole else torch.empty_like(q)
    for g in groups:
        R, Q = g.tok_idx.shape
        L = g.ctx_slots.shape[1]
        # index_select over the flat slot list is ~2x faster than advanced indexing
        flat = g.ctx_slots.reshape(-1)
        kg = k_cache.index_select(0, flat).view(R, L, Hkv, D).transpose(1, 2)  # [R, Hkv, L, D]
        vg = v_cache.index_select(0, flat).view(R, L, Hkv, D).transpose(1, 2)
        if g.whole:
            return _attend(q.view(R, Q, H, D), kg, vg, g.mask, scale, fold)
        o = _attend(q[g.tok_idx], kg, vg, g.mask, scale, fold)  # [R*Q, H, D]
        if o.shape[0] != g.out_idx.shape[0]:
            o = o.index_select(0, g.valid)  # index, not a bool mask: no device sync
        assert out is not None  # groups[0] is not whole
        out[g.out_idx] = o
    assert out is not None  # as above
    return out


def _attend(
    qg: torch.Tensor,
    kg: torch.Tensor,
    vg: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    fold: bool,
) -> torch.Tensor:
    """qg: [R, Q, H, D]; kg, vg: [R, Hkv, L, D]; mask: [R, 1, Q, L] -> [R*Q, H, D]."""
    R, Q, H, D = qg.shape
    Hkv, L = kg.shape[1], kg.shape[2]
    G = H // Hkv
    if G > 1 and (Q == 1 or fold):
        # the G query heads sharing a KV head become G*Q query rows of that head (head
        # h = kv_head * G + g): the kernel reads each KV row once, and needs no GQA
        qf = qg.view(R, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(R, Hkv, G * Q, D)
        mf = mask.unsqueeze(2).expand(R, 1, G, Q, L).reshape(R, 1, G * Q, L)
        o = F.scaled_dot_product_attention(qf, kg, vg, attn_mask=mf, scale=scale)
        return o.view(R, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(R * Q, H, D)
    o = F.scaled_dot_product_attention(
        qg.transpose(1, 2), kg, vg, attn_mask=mask, scale=scale, enable_gqa=G > 1
    )  # [R, H, Q, D]
    return o.transpose(1, 2).reshape(R * Q, H, D)
