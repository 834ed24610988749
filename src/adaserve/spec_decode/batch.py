"""One step's verification batch: every request's token tree, flattened.

Layout (in the manner of vLLM's ``spec_decode/metadata.py``): R requests, N nodes in
all. Request r owns the nodes ``cu_nodes[r] : cu_nodes[r + 1]``, its root first, then
its candidates in tree order (parents before children). A *global* node index is a
position in that flat layout, which is also the row of the verifier's logits
``[N, V]``; a *local* one is an index into the request's own ``CandidateTree``.

Everything structural (who is whose child, which siblings are tried in which order,
which requests are greedy or seeded, which noise each seeded node uses) is known on
the host from the trees, so ``build`` turns it into index tensors once; ``verify``
then only launches device work and copies one result tensor back (see
``adaserve.spec_decode.verify``).

Use in the engine: ``ModelRunner.verify_forward`` builds the batch while it lays out
the forward (a prefill that completes its prompt is a root-only request at its last
token's row; each decoding request's 1+N nodes follow its root), gathers the logits
``[N, V]`` with ``hidden_rows``, and ``engine.verification.accept`` hands them to
``verify``: the step's one device-to-host copy. The commit reads ``VerifyResult`` in
request order with no row counter; ``compact_moves`` gives the KV compaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from adaserve.core.tree import CandidateTree
from adaserve.sampling import SamplingParams
from adaserve.spec_decode.logits import noise_key
from adaserve.spec_decode.penalties import PenaltyRows, tree_paths


@dataclass(frozen=True)
class SiblingStep:
    """The stochastic edges whose child is the j-th child of its parent (one j), for
    requests of one kind (verified with draft q or without). Each parent appears once.

    parent: [M] int64, global index of the parent node
    child:  [M] int64, global index of its j-th child
    with_q: the requests of these edges are verified against ``VerifyBatch.draft_q``
    """

    parent: torch.Tensor
    child: torch.Tensor
    with_q: bool


@dataclass
class VerifyBatch:
    """What one step verifies: the flattened trees and each request's sampling setup.

    Host side (numpy / Python):
      cu_nodes:    [R+1] int64, request r's nodes are cu_nodes[r] : cu_nodes[r+1]
      tokens_host: [N] int64, node tokens, each request's root first
      parents:     [N] int64, global index of each node's parent (a root: itself)
      max_depth:   depth of the deepest candidate in the batch (0: all root-only)
      greedy:      [R] bool, the request decodes greedily (argmax of the raw logits)
      seeded:      [R] bool, stochastic with ``params.seed``: its token at output index
                   o is ``argmax p / E`` with the noise E of ``noise_key(seed, o)``
                   (``logits.race_noise``), so it is verified like a greedy request
                   against that argmax (see ``adaserve.spec_decode.verify``)
      params:      [R] sampling params (temperature / top_k / top_p / min_p are applied
                   by ``target_probs``; greedy requests ignore them; the penalties apply
                   to every request, greedy ones too, through ``penalties``)
      generators:  [R] the request's own generator (None: torch's default generator);
                   only unseeded stochastic requests draw from it
      use_q:       [R] bool, unseeded stochastic and verified against draft q rows
                   (sampled drafts); False: deterministic-draft residual method
      prob_groups: [(params, [M] int64 global node indices)], the stochastic nodes
                   (seeded ones too) grouped by identical processing params (one
                   ``target_probs`` each)
      sibling_steps: unseeded stochastic edges by sibling rank j = 0, 1, ..., each rank
                   split by ``with_q``; the verifier tries rank j before rank j + 1
      noise_keys:  [K] the noise keys of the seeded requests' positions: request r's
                   node at depth d predicts output index ``out_index[r] + d``
    Device side (``device``):
      tokens:      [N] int64, node tokens
      hidden_rows: [N] int64, row of each node in the target forward's hidden states
      draft_q:     [N, V] float32 or None, the draft distribution each node's children
                   were sampled from (zero rows for nodes without one); None when no
                   request has q rows
      roots:       [R] int64, global index of each request's root (cu_nodes[:-1])
      stochastic:  [R_s] int64, indices of the unseeded stochastic requests (residual
                   method: their bonus is an inverse-CDF draw)
      seeded_nodes: [M_s] int64, global indices of the seeded requests' nodes
      noise_rows:  [M_s] int64, the row of ``race_noise(noise_keys)`` each one uses
      argmax_parent, argmax_child: [E_g] int64, the edges of greedy and seeded
                   requests' trees (global indices; empty tensors when there are none)
      penalties:   ``PenaltyRows`` of the nodes of requests with penalties (each node
                   with the counts of its own path: prompt + committed output + its
                   candidates below the root), applied to the logits before anything
                   else; None when no request has one
    """

    cu_nodes: np.ndarray
    tokens_host: np.ndarray
    parents: np.ndarray
    max_depth: int
    greedy: list[bool]
    seeded: list[bool]
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    use_q: list[bool]
    prob_groups: list[tuple[SamplingParams, torch.Tensor]]
    sibling_steps: list[SiblingStep]
    noise_keys: list[int]
    tokens: torch.Tensor
    hidden_rows: torch.Tensor
    draft_q: torch.Tensor | None
    roots: torch.Tensor
    stochastic: torch.Tensor
    seeded_nodes: torch.Tensor
    noise_rows: torch.Tensor
    argmax_parent: torch.Tensor
    argmax_child: torch.Tensor
    device: torch.device
    penalties: PenaltyRows | None = None

    @property
    def num_requests(self) -> int:
        return len(self.cu_nodes) - 1

    @property
    def num_nodes(self) -> int:
        return int(self.cu_nodes[-1])

    @classmethod
    def build(
        cls,
        trees: Sequence[CandidateTree],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        *,
        device: torch.device | str = "cpu",
        first_rows: Sequence[int] | None = None,
        draft_q: Sequence[dict[int, torch.Tensor] | None] | None = None,
        out_index: Sequence[int] | None = None,
        histories: Sequence[tuple[Sequence[int], Sequence[int]] | None] | None = None,
    ) -> VerifyBatch:
        """Flatten the requests' trees (host work plus a few host-to-device copies).

        trees:      R trees (root-only ones too: a completed prefill, a request that
                    did not speculate)
        params, generators: per request, as ``Request.params`` and ``Request.gen``
        first_rows: [R] hidden-state row of each request's root in the target forward,
                    its other nodes following it; None: rows 0..N-1 in node order
        draft_q:    [R] ``DraftOutput.q_rows`` (draft node index -> [V] draft
                    distribution) or None; indexed through ``tree.origin`` when the
                    tree is a subtree of the drafted one. Used for unseeded stochastic
                    requests.
        out_index:  [R] output index (0: the first generated token) of the token each
                    request's root predicts: ``len(tokens) - prompt_len`` before the
                    step; None: 0 for all. Keys the noise of seeded requests.
        histories:  [R] (prompt ids, committed output ids) of each request whose params
                    have penalties (None for the others); required when one has
        """
        R = len(trees)
        lens = {len(params), len(generators)}
        lens |= {len(x) for x in (first_rows, draft_q, out_index, histories) if x is not None}
        if lens - {R}:
            raise ValueError(
                "trees, params, generators, first_rows, draft_q, out_index, histories "
                "differ in length"
            )
        device = torch.device(device)
        sizes = np.array([len(t.tokens) for t in trees], dtype=np.int64)
        if (sizes < 1).any():
            raise ValueError("a tree without a root")
        cu = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(sizes, out=cu[1:])
        N = int(cu[-1])
        off = np.repeat(cu[:-1], sizes)
        cat = np.concatenate
        tokens = cat([np.asarray(t.tokens, dtype=np.int64) for t in trees]) if R else off
        parents = cat([np.asarray(t.parents, dtype=np.int64) for t in trees]) + off if R else off
        idx = np.arange(N)
        is_root = np.zeros(N, dtype=bool)
        is_root[cu[:-1]] = True
        if (parents[is_root] != idx[is_root]).any() or (parents[~is_root] >= idx[~is_root]).any():
            raise ValueError("a tree is not rooted at node 0 with parents before children")
        max_depth = max((int(np.max(t.depth)) for t in trees), default=0)
        greedy = [p.greedy for p in params]
        seeded = [not p.greedy and p.seed is not None for p in params]
        argmax_req = np.array([g or s for g, s in zip(greedy, seeded)], dtype=bool)

        use_q = [False] * R
        q_at: list[int] = []
        q_rows: list[torch.Tensor] = []
        for r, t in enumerate(trees):
            qr = draft_q[r] if draft_q is not None else None
            if argmax_req[r] or not qr or sizes[r] == 1:
                continue
            origin = t.origin if t.origin is not None else np.arange(sizes[r])
            for local in np.unique(np.asarray(t.parents)[1:]):  # the nodes with children
                row = qr.get(int(origin[local]))
                if row is not None:
                    q_at.append(int(cu[r] + local))
                    q_rows.append(row)
                    use_q[r] = True

        # edges (every non-root node and its parent) with the child's rank among its
        # siblings in node order: the order the verifier tries them in
        child = np.flatnonzero(~is_root)
        par = parents[child]
        order = np.argsort(par, kind="stable")
        sp = par[order]
        start = np.flatnonzero(np.r_[True, sp[1:] != sp[:-1]]) if len(sp) else sp
        rank = np.empty_like(child)
        rank[order] = np.arange(len(sp)) - np.repeat(start, np.diff(np.r_[start, len(sp)]))
        req_of_edge = np.searchsorted(cu, child, side="right") - 1
        edge_argmax = argmax_req[req_of_edge]
        edge_q = np.asarray(use_q, dtype=bool)[req_of_edge]

        def t64(a) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a, dtype=np.int64)).to(device)

        steps = []
        for j in range(int(rank.max()) + 1 if len(rank) else 0):
            for with_q in (False, True):
                sel = (rank == j) & ~edge_argmax & (edge_q == with_q)
                if sel.any():
                    steps.append(SiblingStep(t64(par[sel]), t64(child[sel]), with_q))

        groups: dict[tuple, tuple[SamplingParams, list[np.ndarray]]] = {}
        for r, p in enumerate(params):
            if not greedy[r]:
                key = (p.temperature, p.top_k, p.top_p, p.min_p)
                groups.setdefault(key, (p, []))[1].append(np.arange(cu[r], cu[r + 1]))
        prob_groups = [(p, t64(cat(nodes))) for p, nodes in groups.values()]

        # seeded requests: one noise row per (request, depth), keyed by the output index
        keys: list[int] = []
        s_nodes, s_rows = [], []
        for r, t in enumerate(trees):
            if seeded[r]:
                o = int(out_index[r]) if out_index is not None else 0
                depth = np.asarray(t.depth, dtype=np.int64)
                s_nodes.append(np.arange(cu[r], cu[r + 1]))
                s_rows.append(len(keys) + depth)
                seed = params[r].seed
                assert seed is not None  # a seeded request
                keys += [noise_key(seed, o + d) for d in range(int(depth.max()) + 1)]

        penalties = None
        pen = [r for r, p in enumerate(params) if p.penalized]
        if pen:
            pen_rows = []
            for r in pen:
                h = histories[r] if histories is not None else None
                if h is None:
                    raise ValueError("a request with penalties needs its history")
                pen_rows.append((*h, params[r]))
            penalties = PenaltyRows.build(
                pen_rows,
                [
                    list(zip(range(int(cu[r]), int(cu[r + 1])), tree_paths(t.parents, t.tokens)))
                    for r, t in ((r, trees[r]) for r in pen)
                ],
                device,
            )

        q = None
        if q_rows:
            rows = torch.stack([x.to(device=device, dtype=torch.float32) for x in q_rows])
            q = rows.new_zeros(N, rows.shape[-1])
            q[t64(q_at)] = rows
        hidden = idx
        if first_rows is not None:
            hidden = idx - off + np.repeat(np.asarray(first_rows, dtype=np.int64), sizes)
        return cls(
            cu_nodes=cu,
            tokens_host=tokens,
            parents=parents,
            max_depth=max_depth,
            greedy=greedy,
            seeded=seeded,
            params=list(params),
            generators=list(generators),
            use_q=use_q,
            prob_groups=prob_groups,
            sibling_steps=steps,
            noise_keys=keys,
            tokens=t64(tokens),
            hidden_rows=t64(hidden),
            draft_q=q,
            roots=t64(cu[:-1]),
            stochastic=t64([r for r in range(R) if not argmax_req[r]]),
            seeded_nodes=t64(cat(s_nodes) if s_nodes else []),
            noise_rows=t64(cat(s_rows) if s_rows else []),
            argmax_parent=t64(par[edge_argmax]),
            argmax_child=t64(child[edge_argmax]),
            device=device,
            penalties=penalties,
        )


def compact_moves(path: Sequence[int], committed: int) -> tuple[list[int], list[int]]:
    """KV positions to copy so that the root and the accepted path lie contiguously.

    The verification forward wrote node i of the tree at position ``C - 1 + i``
    (``C = committed``, the request's token count before this step; the root, the last
    committed token, at ``C - 1``). Accepted node ``path[j]`` must end at ``C + j``.
    Returns (source positions, destination positions) of the nodes not already in
    place, to be mapped to slots by the block table and copied with every source read
    before any destination is written (as ``KVCache.move_slots`` does).
    """
    src, dst = [], []
    for j, node in enumerate(path):
        if node != j + 1:
            src.append(committed - 1 + int(node))
            dst.append(committed + j)
    return src, dst
